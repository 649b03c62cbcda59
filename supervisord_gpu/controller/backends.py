"""What a real run and a rehearsal differ in, as one record made once where the daemon is assembled.

A rehearsal swaps SGLang for stand-ins and NVML for simulated GPUs, checks the profile's options
against the option table, and does not ask for the model on disk. Those four choices are made
together in daemon.py (`backends_for`), real or rehearsal, and handed down: nothing below the
assembly asks "is this a rehearsal?" again, and `controller/` never imports `rehearsal/`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..checks.gpus import GpuInventory
from ..config.render import Programs
from ..sglang.flags import FlagCheck

#: (process name, its rendered SGLang arguments) for each server -> one FlagCheck each
FlagChecker = Callable[[Iterable[tuple[str, list[str]]]], list[FlagCheck]]


class Backends:
    """The programs to run and their environment, the GPU inventory, the flag checker, and whether
    model paths must exist: real or rehearsal, one record (see the module docstring)."""

    def __init__(self, programs: Programs, open_inventory: Callable[[], GpuInventory], check_flags: FlagChecker,
                 model_paths_must_exist: bool, rehearsal: bool = False) -> None:
        #: what servers and routers run as, and the environment the children gain
        self.programs = programs
        #: the servers' options against the SGLang that will run (or its option table)
        self.check_flags = check_flags
        #: a server's model_path must exist here before a start (a rehearsal's stand-ins load nothing)
        self.model_paths_must_exist = model_paths_must_exist
        #: said in the journal's first line
        self.rehearsal = rehearsal
        self._open_inventory = open_inventory
        self._inventory: GpuInventory | None = None

    @property
    def inventory(self) -> GpuInventory:
        """The machine's GPUs (NVML, or the simulated ones), opened on first use and then always the
        same one: NVML's learned baselines live in it, and `gpusupctl render` never needs it."""
        if self._inventory is None:
            self._inventory = self._open_inventory()
        return self._inventory
