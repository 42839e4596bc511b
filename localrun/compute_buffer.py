"""The compute buffer llama.cpp reserves for a decoder: its graph for one full ubatch, replayed
through ggml-alloc's allocator (greedy best fit, tensors freed after their last use, in place
where an op allows it).

llama.cpp sizes the buffer by allocating the graph of n_ubatch tokens against a KV cache of every
cell (llama_context::sched_reserve); the peak depends on which tensors are alive together and on
the holes their order leaves, so it is replayed here rather than summed. The graph is llama's
(llm_build_llama: RMS norms, RoPE, attention with or without flash attention, SwiGLU or a
mixture of experts), which the other decoders differ from only in small tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGNMENT = 32  # ggml's TENSOR_ALIGNMENT: every tensor's size rounds up to it
F32 = 4
# ggml_op_can_inplace: ops whose result may take its operand's memory
_IN_PLACE = frozenset({"add", "mul", "div", "rms_norm", "rope", "soft_max", "clamp", "scale"})


@dataclass(frozen=True)
class Decoder:
    """The dimensions a decoder's compute graph depends on."""

    vocab: int
    embedding: int
    layers: int
    heads: int
    kv_heads: int
    key_dim: int
    value_dim: int
    feed_forward: int  # the dense layers' (0: none)
    experts: int = 0
    experts_used: int = 0
    expert_feed_forward: int = 0
    shared_feed_forward: int = 0  # shared experts beside the routed ones (0: none)
    dense_layers: int = 0  # leading layers with a dense feed-forward block in a mixture of experts


class _Tensor:
    def __init__(self, size: int, op: str, srcs: list[_Tensor], base: _Tensor | None = None,
                 output: bool = False) -> None:
        self.size, self.op, self.srcs, self.base, self.output = size, op, srcs, base, output
        self.placed = op not in ("input", "view", "set_rows")  # the allocator places it when its node runs
        self.children = self.views = 0
        self.owned = False  # its memory is allocated by the allocator and not yet freed
        self.offset = 0


class _Allocator:
    """ggml_dyn_tallocr: best fit among the free blocks, else the block at the end, which grows."""

    def __init__(self) -> None:
        self.free: list[list[int]] = [[0, 1 << 62]]  # [offset, size] by offset; the last never ends
        self.peak = 0

    def alloc(self, size: int) -> int:
        size = -(-size // ALIGNMENT) * ALIGNMENT
        best = -1
        for i, (_, free) in enumerate(self.free[:-1]):
            if free >= size and (best < 0 or free <= self.free[best][1]):
                best = i
        block = self.free[best]
        offset = block[0]
        block[0] += size
        block[1] -= size
        if block[1] == 0:
            del self.free[best]
        self.peak = max(self.peak, offset + size)
        return offset

    def release(self, offset: int, size: int) -> None:
        size = -(-size // ALIGNMENT) * ALIGNMENT
        for i, block in enumerate(self.free):
            if block[0] + block[1] == offset:  # right after this block
                block[1] += size
                if i + 1 < len(self.free) and block[0] + block[1] == self.free[i + 1][0]:
                    block[1] += self.free.pop(i + 1)[1]
                return
            if offset + size == block[0]:  # right before it
                block[0] = offset
                block[1] += size
                if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == offset:
                    self.free[i - 1][1] += self.free.pop(i)[1]
                return
        self.free.append([offset, size])
        self.free.sort()


class _Graph:
    """Nodes in llama.cpp's order; leaves are the inputs (weights and the KV cache need no memory here)."""

    def __init__(self) -> None:
        self.inputs: list[_Tensor] = []
        self.nodes: list[_Tensor] = []

    def input(self, size: int) -> _Tensor:
        t = _Tensor(size, "input", [])
        self.inputs.append(t)
        return t

    def op(self, op: str, size: int, *srcs: _Tensor | None, output: bool = False) -> _Tensor:
        t = _Tensor(size, op, [s for s in srcs if s is not None], output=output)
        self.nodes.append(t)
        return t

    def view(self, src: _Tensor) -> _Tensor:
        t = _Tensor(src.size, "view", [src], base=src.base or src)
        self.nodes.append(t)
        return t

    def set_rows(self, *srcs: _Tensor) -> None:
        """A write into the KV cache, which has memory of its own."""
        self.nodes.append(_Tensor(0, "set_rows", list(srcs)))

    def peak(self) -> int:
        """ggml_gallocr_alloc_graph_impl: inputs first, then each node; a parent is freed after its last child."""
        alloc = _Allocator()
        for t in self.inputs:
            t.offset, t.owned = alloc.alloc(t.size), True
        for n in self.nodes:
            if n.base is not None:
                n.base.views += 1
            for s in n.srcs:
                s.children += 1
        for n in self.nodes:
            if n.placed:
                self._place(n, alloc)
            for p in n.srcs:
                p.children -= 1
                if p.children or p.views:
                    continue
                if p.base is not None:
                    p.base.views -= 1
                    if not p.base.views and not p.base.children:
                        self._free(p.base, alloc)
                else:
                    self._free(p, alloc)
        return alloc.peak

    @staticmethod
    def _place(n: _Tensor, alloc: _Allocator) -> None:
        n.owned = True
        if n.op in _IN_PLACE:
            for p in n.srcs:
                if p.owned and not p.output and p.size == n.size and p.children == 1 and not p.views:
                    n.offset, p.owned = p.offset, False
                    return
        n.offset = alloc.alloc(n.size)

    @staticmethod
    def _free(t: _Tensor, alloc: _Allocator) -> None:
        if t.owned and not t.output:
            alloc.release(t.offset, t.size)
            t.owned = False


def compute_buffer_bytes(d: Decoder, cells: int, tokens: int, flash_attn: bool, k_rotation: int = 0,
                         v_rotation: int = 0, host_inputs: bool = True, outputs: int | None = None) -> int:
    """The peak of llama.cpp's graph for a ubatch of `tokens` against `cells` KV cells per
    sequence (every sequence's stream together: tokens are spread over them, as cells are), with
    `outputs` rows of logits (default: one per token).

    k_rotation, v_rotation: the side of the Hadamard matrix a quantized K or V cache rotates by (0:
    none). host_inputs=False: the token ids and embeddings stay in host memory (a GPU's graph)."""
    g = _Graph()
    a = d.embedding * tokens * F32
    n_out = tokens if outputs is None else outputs
    a_out = d.embedding * n_out * F32
    if host_inputs:
        ids = g.input(tokens * 4)
        g.input(a)  # inp_embd, the batch's own embeddings: allocated though this batch has tokens
        x = g.op("get_rows", a, ids)
    else:
        x = g.input(a)
    q_size = d.heads * d.key_dim * tokens * F32
    k_size = d.kv_heads * d.key_dim * tokens * F32
    v_size = d.kv_heads * d.value_dim * tokens * F32
    attn_size = d.heads * d.value_dim * tokens * F32
    lazy: dict[str, _Tensor] = {}

    def once(name: str, size: int) -> _Tensor:  # an input, allocated in the order of first use
        if name not in lazy:
            lazy[name] = g.input(size)
        return lazy[name]

    def rotate(t: _Tensor, side: int, name: str) -> _Tensor:  # llama_mul_mat_hadamard
        if not side:
            return t
        return g.view(g.op("mul_mat", t.size, once(name, side * side * F32), g.view(t)))

    for il in range(d.layers):
        last = il == d.layers - 1
        norm = g.op("mul", a, g.op("rms_norm", a, x))
        pos = once("pos", tokens * 4)
        q = rotate(g.op("rope", q_size, g.view(g.op("mul_mat", q_size, norm)), pos), k_rotation, "k_rot")
        v = rotate(g.op("mul_mat", v_size, norm), v_rotation, "v_rot")
        k = rotate(g.op("rope", k_size, g.view(g.op("mul_mat", k_size, norm)), pos), k_rotation, "k_rot")
        g.set_rows(g.view(k), once("k_idxs", tokens * 8))
        # without flash attention V is stored transposed: one index per value
        g.set_rows(g.view(v), once("v_idxs", tokens * 8 * (1 if flash_attn else d.kv_heads * d.value_dim)))
        mask = once("mask", cells * tokens * (2 if flash_attn else F32))
        if flash_attn:
            cur = g.view(g.op("flash_attn_ext", attn_size, g.view(q), mask))
        else:
            kq = g.op("soft_max", cells * tokens * d.heads * F32,
                      g.op("mul_mat", cells * tokens * d.heads * F32, g.view(q)), mask)
            cur = g.op("cont", attn_size, g.view(g.op("mul_mat", attn_size, kq)))
        cur = g.op("mul_mat", a, rotate(cur, v_rotation, "v_rot"))
        rows, size = tokens, a
        if last:  # only the rows of the outputs go on
            out_ids = once("out_ids", n_out * 4)
            rows, size = n_out, a_out
            cur, x = g.op("get_rows", size, cur, out_ids), g.op("get_rows", size, x, out_ids)
        ffn_inp = g.op("add", size, cur, x)
        norm = g.op("mul", size, g.op("rms_norm", size, ffn_inp))
        if d.experts and il >= d.dense_layers:
            cur = _moe(g, d, norm, rows, size)
        else:
            cur = _ffn(g, norm, d.feed_forward * rows * F32, size)
        x = g.op("add", size, cur, ffn_inp)
    norm = g.op("mul", a_out, g.op("rms_norm", a_out, x), output=True)
    g.op("mul_mat", d.vocab * n_out * F32, norm, output=True)
    return g.peak()


def rotation(head_dim: int, kv_type: str, key: bool) -> int:
    """The side of the Hadamard matrix a quantized cache rotates heads by (llama_kv_cache), 0 for
    none: for K the largest power of two from 64 that divides the head, for V 64."""
    if kv_type in ("f32", "f16", "bf16") or head_dim % 64:
        return 0
    side = 64
    while key and head_dim % (side * 2) == 0:
        side *= 2
    return side


def host_input_bytes(d: Decoder, cells: int, tokens: int, flash_attn: bool) -> int:
    """The batch's inputs llama.cpp keeps in host memory when a GPU runs every layer: token ids,
    embeddings (the batch's own and the looked-up rows), positions, cache indices and the mask."""
    v_idxs = tokens * 8 * (1 if flash_attn else d.kv_heads * d.value_dim)
    return 2 * d.embedding * tokens * F32 + 3 * tokens * 4 + tokens * 8 + v_idxs + cells * tokens * (2 if flash_attn else F32)


def _ffn(g: _Graph, x: _Tensor, hidden: int, a: int) -> _Tensor:
    gate, up = g.op("mul_mat", hidden, x), g.op("mul_mat", hidden, x)
    return g.op("mul_mat", a, g.op("swiglu", hidden, gate, up))


def _moe(g: _Graph, d: Decoder, x: _Tensor, tokens: int, a: int) -> _Tensor:
    """llm_graph_context::build_moe_ffn: softmax routing, top-k, weights normalised, SwiGLU experts."""
    probs = g.op("soft_max", d.experts * tokens * F32, g.op("mul_mat", d.experts * tokens * F32, x))
    top = g.view(g.op("argsort", d.experts * tokens * 4, probs))
    weights = g.op("get_rows", d.experts_used * tokens * F32, g.view(probs), top)
    total = g.op("clamp", tokens * F32, g.op("sum_rows", tokens * F32, g.view(weights)))
    weights = g.view(g.op("div", weights.size, g.view(weights), total))
    rows = g.view(x)
    hidden = d.expert_feed_forward * d.experts_used * tokens * F32
    gate, up = g.op("mul_mat_id", hidden, rows, top), g.op("mul_mat_id", hidden, rows, top)
    down = g.op("mul_mat_id", d.embedding * d.experts_used * tokens * F32, g.op("swiglu", hidden, gate, up), top)
    weighted = g.op("mul", down.size, down, weights)
    cur = g.view(weighted)
    for _ in range(1, d.experts_used):
        cur = g.op("add", a, cur, g.view(weighted))
    if d.shared_feed_forward:
        cur = g.op("add", a, cur, _ffn(g, x, d.shared_feed_forward * tokens * F32, a))
    return cur
