"""Parking a profile: its CUDA processes suspended into host memory, and brought back.

checkpointer.py  the protocol (lock, checkpoint, restore, unlock, state per PID) and its states
driver.py        NVIDIA's driver API (cuCheckpointProcess*, driver >= 570) through ctypes on libcuda
binary.py        NVIDIA's `cuda-checkpoint` utility where it is installed
simulated.py     the rehearsal's: a stand-in's simulated GPU memory moved aside, as if to host
fake.py          an in-memory one for the decisions' tests
decisions.py     the pure decisions: which PIDs, enough host memory, what a restore's outcome means
hostmem.py       MemAvailable, read from /proc/meminfo into a typed figure
"""
