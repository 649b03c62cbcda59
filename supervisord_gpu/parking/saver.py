"""SGLang's memory saver around a park: the KV pool released before the checkpoint, resumed after.

Why: a checkpoint copies everything the scheduler holds on the GPU, the KV pool included, whose
contents are worth nothing once the server is drained. Measured on an H100 (2026-12-07,
SGLang 0.5.23, torch_memory_saver 0.0.10, bench/results/real-park-h100-*.json), the tiny model
at mem-fraction 0.25:

    checkpoint of the whole server:           22.8 GB moved, parked in 8.7 s, serving 2.99 s after
    KV pool released first (this module):      1.7 GB moved, parked in 1.0 s, serving 0.62 s after

The servers it applies to are those started with `--enable-memory-saver` (its allocations then
go through torch_memory_saver, whose virtual addresses survive a release, so the CUDA graphs stay
valid). The order is SGLang's own, the one RL trainers use between rollouts:

    park     POST /pause_generation {"mode": "retract"}   running requests go back to the
                                                           waiting queue; new ones wait at the
                                                           front end until the continue
             POST /release_memory_occupation {"tags": ["kv_cache"]}
    restore  POST /resume_memory_occupation {"tags": ["kv_cache"]}
             POST /continue_generation

The pause is not optional: a generation that reaches a released pool crashes the scheduler (seen
on the H100: "Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)", then SGLang
killed itself), and SGLang asserts an idle scheduler for the release unless generation is paused.

The answers come from the server's front end, where model code runs: only the status is used (200
or not), the body only in the one line that says what went wrong. The calls carry the server's
admin key and go only to a process of the server's own cgroup (the Parker's peer check).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from ..errors import one_line
from ..records import dataclass
from .checkpointer import CheckpointError

SAVER_FLAG = "--enable-memory-saver"
KV_TAGS = ["kv_cache"]
#: each call; the pause and the release answer in about 0.02 s on the H100
CALL_TIMEOUT_S = 20.0

#: (server, path, JSON body) -> (status or None, the answer's first bytes)
Post = Callable[[str, str, object], Awaitable[tuple[int | None, bytes]]]

RELEASE_STEPS: tuple[tuple[str, object], ...] = (
    ("/pause_generation", {"mode": "retract"}),
    ("/release_memory_occupation", {"tags": KV_TAGS}),
)
RESUME_STEPS: tuple[tuple[str, object], ...] = (
    ("/resume_memory_occupation", {"tags": KV_TAGS}),
    ("/continue_generation", {}),
)


def uses_saver(argv: Iterable[str]) -> bool:
    """Was this server started with SGLang's memory saver (the flag alone, or =true)?"""
    for arg in argv:
        if arg == SAVER_FLAG:
            return True
        if arg.startswith(SAVER_FLAG + "="):
            return arg.partition("=")[2].strip().lower() in ("1", "true", "yes", "on")
    return False


class SaverError(CheckpointError):
    """A memory-saver call that failed; `answered` when the server said no (so it did nothing),
    not when the answer never came (it may have done it)."""

    def __init__(self, message: str, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered


@dataclass
class SaverSteps:
    """What may have been done to each server (recorded before each call is sent, dropped only
    when the server answered no), so that a failure or a cancel undoes at least that."""

    paused: list[str]
    released: list[str]


async def release_kv(servers: list[str], post: Post, done: SaverSteps) -> None:
    """Pause (retract) and release the KV pool of each server, in order, recording into `done`;
    the first failure raises SaverError naming the server, the call and the answer. Undoing is
    the caller's (`undo`, once the front ends run again): a cancel lands here too."""
    for server in servers:
        for path, body in RELEASE_STEPS:
            steps = done.paused if path == "/pause_generation" else done.released
            steps.append(server)
            try:
                await _call(post, server, path, body)
            except SaverError as e:
                if e.answered:
                    steps.remove(server)
                raise


async def resume_kv(servers: list[str], post: Post) -> None:
    """Resume the KV pool and continue generation on each server; the first failure raises
    (the restore then failed: the Parker stops the profile and starts it cold)."""
    for server in servers:
        for path, body in RESUME_STEPS:
            await _call(post, server, path, body)


@dataclass
class Undone:
    """What an undo could not do: one line per failure, and the servers it knows are still paused
    (server -> why), which the Parker restarts cold: paused, such a server holds every request
    for ever, and the hang check rightly takes a pause for work."""

    lines: list[str]
    left_paused: dict[str, str]


async def undo(done: SaverSteps, post: Post) -> Undone:
    """Best effort, each server on its own: resume what may have been released, then continue
    what may have been paused. A server whose resume fails is not continued (a request would
    reach a released pool and crash it): left paused. So is one whose continue the server
    answered with a refusal; one whose continue got no answer may have continued, and is left to
    the hang check (a front end that does not answer is its case). Never raises."""
    undone = Undone([], {})
    for server in done.paused:
        steps = RESUME_STEPS if server in done.released else RESUME_STEPS[1:]
        for path, body in steps:
            try:
                await _call(post, server, path, body)
            except SaverError as e:
                if path == "/resume_memory_occupation":
                    undone.left_paused[server] = "its KV pool released"
                elif e.answered:
                    undone.left_paused[server] = "generation not continued"
                undone.lines.append(str(e) + ("; left paused" if server in undone.left_paused else ""))
                break
    return undone


async def _call(post: Post, server: str, path: str, body: object) -> None:
    status, answer = await post(server, path, body)
    if status != 200:
        said = one_line(answer.decode(errors="replace"))[:200] if answer else ""
        got = f"answered {status}" if status is not None else "no answer"
        raise SaverError(f"{server}: POST {path} {got}{': ' + said if said else ''}", status is not None)
