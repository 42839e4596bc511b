"""Speculative decoding on the llama.cpp engine: loading its draft model, the draft model's
drafts, and the share of drafts a sequence must keep for drafting to pay (the step verifies them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from localrun.backends.drafting import StepCost
from localrun.backends.llama_draft import DraftModel, vocab_facts
from localrun.errors import EngineError, UsageError
from localrun.settings import LoadOptions

if TYPE_CHECKING:
    from localrun.backends.llama_cpp import _Seq


class LlamaSpeculative:
    """The engine's drafting: its draft model (--draft MODEL), and what drafts cost against a step."""

    ll: Any
    vocab: Any
    n_ctx: int
    n_slots: int
    n_batch: int
    threads: int
    gpu_layers: int
    seqs: list[_Seq | None]
    drafter: DraftModel | None
    draft_refused: str | None
    _cost: StepCost

    if TYPE_CHECKING:  # defined by the engine
        def close(self) -> None:
            ...

    def _load_drafter(self, options: LoadOptions) -> None:
        from pathlib import Path

        assert options.draft is not None
        name = Path(options.draft).name
        try:
            if Path(options.draft).is_dir():
                raise UsageError(f"draft model '{name}' is an MLX folder, and on llama.cpp a draft model is a GGUF file",
                                 "pick a GGUF draft model, or use --draft lookup")
            self.drafter = DraftModel(self.ll, options.draft, name, vocab_facts(self.ll, self.vocab), self.n_ctx,
                                      self.n_slots, self.threads, self.gpu_layers, self.n_batch)
        except UsageError as e:
            if not options.draft_optional:
                self.close()
                raise
            self.draft_refused = e.message
        except BaseException:
            self.close()
            raise

    def _min_rate(self, model: bool, sequences: int) -> float:
        """The share of its drafted tokens a sequence must keep for drafting (with the draft model,
        or by lookup) to pay, with this many sequences decoding (StepCost)."""
        if not model:
            return self._cost.min_rate(sequences, 0.0, 0.3)
        d = self.drafter
        per_token = d.seconds / d.drafted if d is not None and d.drafted else 0.0
        return self._cost.min_rate(sequences, per_token, 0.6)

    def _model_drafts(self, wants: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """The draft model's drafts for these sequences; none (and no more drafting for them) if it fails."""
        assert self.drafter is not None
        try:
            return self.drafter.draft(wants)
        except EngineError:
            for s in wants:
                q = self.seqs[s]
                if q is not None and q.control is not None:
                    q.control.off = True
            return {}

    def drafts(self, slot: int) -> tuple[int, int]:
        """Tokens drafted for the slot's reply so far, and how many of them the model kept."""
        q = self.seqs[slot]
        return (q.control.drafted, q.control.accepted) if q is not None and q.control is not None else (0, 0)
