"""A child's output as a terminal would show it: finished lines, and the progress bar being drawn.

SGLang's long start-up phases (weights, CUDA-graph capture, DeepGEMM JIT: minutes) print tqdm
bars: each update is `\\r` + the bar, and only the end of the bar is a `\\n`. Reading lines
would see nothing for minutes and call a healthy start stalled; it would also buffer a
never-ending "line". So the reader takes whatever bytes arrive (that alone is progress) and
splits them here into

* lines: text up to a `\\n`, as a terminal leaves it (the part after the line's last `\\r`);
* the progress text: the newest `\\r` segment of the unfinished line (the bar as it looks now).

The unfinished remainder is cut to its last `\\r` segment, so a bar that redraws itself for
twenty minutes costs one bar's worth of memory.
"""

from __future__ import annotations

from ..records import dataclass, field

LINE_LIMIT = 1 << 20  # a longer line is forwarded in pieces of this size


@dataclass
class Split:
    """What one chunk of output contained."""

    lines: list[str] = field(default_factory=list)
    #: the bar as it looks after this chunk, when the chunk redrew it; None otherwise
    progress: str | None = None


class OutputSplitter:
    """Feed it bytes as they arrive; get finished lines and the current progress text back."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> Split:
        out = Split()
        buf = self._pending + data
        *complete, rest = buf.split(b"\n")
        for raw in complete:
            out.lines.append(_visible(raw))
        if b"\r" in rest:
            head, _, tail = rest.rpartition(b"\r")
            shown = tail or head.rpartition(b"\r")[2]
            if shown.strip():
                out.progress = _decode(shown)
            rest = tail
        while len(rest) > LINE_LIMIT:
            out.lines.append(_decode(rest[:LINE_LIMIT]))
            rest = rest[LINE_LIMIT:]
        self._pending = rest
        return out

    def close(self) -> list[str]:
        """What is left when the stream ends (a last line without `\\n`)."""
        rest, self._pending = self._pending, b""
        return [_decode(rest)] if rest.strip() else []


def _visible(raw: bytes) -> str:
    """A finished line as a terminal leaves it: the text after its last `\\r` (a bar's final state)."""
    raw = raw.rstrip(b"\r")
    if b"\r" in raw:
        raw = raw.rpartition(b"\r")[2]
    return _decode(raw)


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")
