"""ns per event of kvwatch's handlers and of reference programs, from the kernel's BPF
statistics (kernel.bpf_stats_enabled), on the same attach points and traffic.

Each group of programs (kvwatch's in one record layout, or one kind of reference program)
is measured alone on its attach points, in windows that take turns (one order, then the
reverse): the first program to run on a tracepoint finds the socket's cache lines cold and
pays for it, as a handler does in production, where it runs alone; side by side, the later
ones would look cheaper than they are. The references (bench/bpf/calibrate.bpf.c): an empty
program (the floor: what being attached and measured costs), one clock read, one
socket-storage lookup, one LRU lookup (each on every event of the ACK path), and on each
attach point one lookup and one clock read together for the watched port's sockets, leaving
others at once as kvwatch's handlers do (the handler target: that + 50 ns).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from bench.token_load import TokenLoad
from kvwatch.collect.bpf.btf import datasec_offset
from kvwatch.collect.bpf.libbpf import check_ptr, check_rc, libbpf
from kvwatch.collect.bpf.loader import STORAGES, BpfPrograms, CollectorSettings
from kvwatch.collect.bpf.runstats import ProgramRunStats, program_run_stats, set_stats_enabled
from kvwatch.errors import BpfError

CALIBRATE_OBJECT = Path(__file__).with_name("calibrate.bpf.o")
WINDOW_SECONDS = 2.0
ROUNDS = 2
# The floor each kvwatch attach point is compared with: an empty program on the same
# tracepoint.
FLOOR = {"send": "calibrate_empty_send", "ack": "calibrate_empty", "read": "calibrate_empty_read"}
# The least a handler of each layout can do on an attach point: its lookup and a clock read.
LOOKUP_AND_CLOCK = {"sk_storage": "calibrate_storage_clock", "lru_hash": "calibrate_lookup_clock"}
# Reference programs measured together: at most one on each tracepoint.
REFERENCE_GROUPS = (
    tuple(FLOOR.values()),
    *(tuple(f"{prefix}_{point}" for point in FLOOR) for prefix in LOOKUP_AND_CLOCK.values()),
    ("calibrate_clock",),
    ("calibrate_storage",),
    ("calibrate_lookup",),
)


def watch_port(handle: int, port: int) -> None:
    """Sets `calibrate_port` of an opened, not yet loaded calibration object."""
    lib = libbpf()
    btf = check_ptr(lib.bpf_object__btf(handle), "read the calibration object's BTF")
    offset, size = datasec_offset(btf, ".rodata", "calibrate_port")
    value = ctypes.c_uint16(port)
    if size != ctypes.sizeof(value):
        raise BpfError("calibrate_port is not a u16", "rebuild it with `make -C bench/bpf`")
    rodata_map = check_ptr(lib.bpf_object__find_map_by_name(handle, b".rodata"), "find .rodata")
    rodata_size = ctypes.c_size_t()
    rodata = check_ptr(
        lib.bpf_map__initial_value(rodata_map, ctypes.byref(rodata_size)), "map .rodata"
    )
    ctypes.memmove(rodata + offset, ctypes.addressof(value), size)


@contextmanager
def calibration_object(port: int) -> Iterator[dict[str, int]]:
    """The reference programs, loaded for sockets on `port` (the lookup+clock ones) but not
    attached: name -> libbpf program handle."""
    lib = libbpf()
    handle = check_ptr(
        lib.bpf_object__open_file(str(CALIBRATE_OBJECT).encode(), None),
        f"open {CALIBRATE_OBJECT} (run `make -C bench/bpf`)",
    )
    try:
        watch_port(handle, port)
        check_rc(lib.bpf_object__load(handle), "load the calibration programs")
        programs: dict[str, int] = {}
        program = lib.bpf_object__next_program(handle, None)
        while program:
            programs[lib.bpf_program__name(program).decode()] = program
            program = lib.bpf_object__next_program(handle, program)
        yield programs
    finally:
        lib.bpf_object__close(handle)


@contextmanager
def references_attached(
    programs: dict[str, int], names: tuple[str, ...]
) -> Iterator[dict[str, int]]:
    """The named reference programs attached for the length of the block: name -> fd."""
    lib = libbpf()
    links: list[int] = []
    try:
        for name in names:
            links.append(check_ptr(lib.bpf_program__attach(programs[name]), f"attach {name}"))
        yield {name: lib.bpf_program__fd(programs[name]) for name in names}
    finally:
        for link in links:
            lib.bpf_link__destroy(link)


@contextmanager
def layout_attached(programs: BpfPrograms, storage: str) -> Iterator[dict[str, int]]:
    """kvwatch's programs in one record layout attached for the block: name -> fd."""
    programs.resume()
    try:
        yield {f"{storage}.{point}": fd for point, fd in programs.program_fds().items()}
    finally:
        programs.pause()


class Totals:
    """Run counts and times by program, and the tokens written while each was attached."""

    def __init__(self) -> None:
        self.runs: dict[str, ProgramRunStats] = {}
        self.tokens: dict[str, int] = {}

    def window(self, load: TokenLoad, fds: dict[str, int]) -> None:
        """WINDOW_SECONDS of the programs `fds` (name -> fd), which are attached."""
        before = {name: program_run_stats(fd) for name, fd in fds.items()}
        start = load.read()
        time.sleep(WINDOW_SECONDS)
        end = load.read()
        for name, fd in fds.items():
            after, seen = program_run_stats(fd), self.runs.get(name, ProgramRunStats(0, 0))
            self.runs[name] = ProgramRunStats(
                seen.run_count + after.run_count - before[name].run_count,
                seen.run_time_ns + after.run_time_ns - before[name].run_time_ns,
            )
            self.tokens[name] = self.tokens.get(name, 0) + end.tokens - start.tokens

    def cost(self, name: str) -> dict[str, float]:
        stats, tokens = self.runs[name], self.tokens[name]
        return {
            "ns_per_event": round(stats.average_ns, 1),
            "events_per_token": round(stats.run_count / tokens, 3) if tokens else 0.0,
        }


def measure_groups(load: TokenLoad) -> Totals:
    """Every group alone, ROUNDS times, in turns (one order, then the reverse)."""
    totals = Totals()
    layouts = {
        storage: BpfPrograms(CollectorSettings(ports=(load.port,), storage=storage), readable=False)
        for storage in STORAGES
    }
    previous = set_stats_enabled(True)
    try:
        for programs in layouts.values():
            programs.pause()
        with calibration_object(load.port) as references:
            groups: list[Callable[[], AbstractContextManager[dict[str, int]]]] = [
                *(partial(layout_attached, layouts[storage], storage) for storage in STORAGES),
                *(partial(references_attached, references, names) for names in REFERENCE_GROUPS),
            ]
            for round_index in range(ROUNDS):
                for group in groups if round_index % 2 == 0 else groups[::-1]:
                    with group() as fds:
                        totals.window(load, fds)
    finally:
        set_stats_enabled(previous)
        for programs in layouts.values():
            programs.close()
    return totals


def handler_costs(load: TokenLoad) -> dict[str, Any]:
    """ns per event and events per token of each attach point in both record layouts and
    of the reference programs, each measured alone (module docstring)."""
    totals = measure_groups(load)
    reference = {name: totals.cost(name) for name in totals.runs if name.startswith("calibrate")}
    result: dict[str, Any] = {}
    for storage in STORAGES:
        points = {
            name.split(".", 1)[1]: totals.cost(name)
            for name in totals.runs
            if name.startswith(f"{storage}.")
        }
        ns_per_token = sum(points[h]["ns_per_event"] * points[h]["events_per_token"] for h in FLOOR)
        result[storage] = {**points, **reference, "bpf_ns_per_token": round(ns_per_token, 1)}
    return result
