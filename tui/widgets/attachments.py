"""Image chips: an attached image's name, format and size, above its message in the conversation,
and above the prompt while it waits for the next message (removable there)."""

from __future__ import annotations

from collections.abc import Iterable

from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Static

from tui.attachments import Attachment


class ImageChip(Static):
    """One image: 'cat.png · PNG 112x84, 3.1 KB'."""

    def __init__(self, attachment: Attachment, text: str | None = None) -> None:
        super().__init__(text or attachment.label, markup=False)
        self.attachment = attachment


class PendingImageChip(ImageChip):
    """An image attached to the next message: a click, or Delete while it has focus, removes it."""

    can_focus = True
    BINDINGS = [Binding("delete,backspace", "remove", "Remove", show=False)]

    class Removed(Message):
        """The user took the image off the next message."""

        def __init__(self, chip: PendingImageChip) -> None:
            super().__init__()
            self.chip = chip

    def __init__(self, attachment: Attachment) -> None:
        super().__init__(attachment, f"{attachment.label}  ×")
        self.tooltip = "Click or press Delete to remove it"

    def on_click(self) -> None:
        self.post_message(self.Removed(self))

    def action_remove(self) -> None:
        self.post_message(self.Removed(self))


class ImageChips(Vertical):
    """A sent message's images, above its text."""

    def __init__(self, attachments: Iterable[Attachment]) -> None:
        super().__init__(*(ImageChip(a) for a in attachments), classes="message")


class AttachmentTray(Vertical):
    """The images attached to the next message, above the prompt; hidden while there are none."""

    def __init__(self) -> None:
        super().__init__(id="attachments")
        self.items: list[Attachment] = []
        self.display = False

    async def add(self, attachment: Attachment) -> None:
        """Attach one more image."""
        self.items.append(attachment)
        self.display = True
        await self.mount(PendingImageChip(attachment))

    async def discard(self, chip: PendingImageChip) -> None:
        """Take one image off."""
        chips = list(self.query(PendingImageChip))
        if chip in chips:
            del self.items[chips.index(chip)]
            await chip.remove()
        self.display = bool(self.items)

    async def pop(self) -> Attachment | None:
        """Take the last image off (None when there is none)."""
        chips = list(self.query(PendingImageChip))
        if not chips:
            return None
        attachment = chips[-1].attachment
        await self.discard(chips[-1])
        return attachment

    async def take(self) -> tuple[Attachment, ...]:
        """Every attached image, for the message being sent; the tray is empty after."""
        items = tuple(self.items)
        self.items = []
        await self.remove_children()
        self.display = False
        return items
