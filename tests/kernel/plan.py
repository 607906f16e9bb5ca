"""Which attach-mode combinations the kernel matrix forces on a kernel, and what each covers.

A combination forces one send mode and one tracepoint mode. Each send mode is paired with the
tracepoint mode that reads kernel memory the same way (fentry and tp_btf with plain loads of
BTF-typed pointers, kprobe and raw_tp through bpf_probe_read_kernel), so both reading flavours
are exercised wherever the kernel offers them; a tracepoint mode that no runnable pair covers
gets its own pair with the best runnable send mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.collect.bpf.loader import SEND_MODES, TRACEPOINT_ATTACH_POINTS, TRACEPOINT_MODES

FLAVOUR_PARTNER = {"fentry": "tp_btf", "kprobe": "raw_tp", "tp_btf": "tp_btf", "raw_tp": "raw_tp"}
PROBE0_MODES = ("fentry", "kprobe")

Offers = dict[str, dict[str, str | None]]


@dataclass(frozen=True)
class Combo:
    """One forced pair of modes; `unavailable` says why the kernel cannot run it (or None)."""

    send: str
    tracepoint: str
    unavailable: str | None

    @property
    def id(self) -> str:
        return f"{self.send}+{self.tracepoint}"

    def point_modes(self, offers: Offers) -> dict[str, str]:
        """The mode each attach point attaches in under this pair, as the loader reports it."""
        modes = {"send": self.send, **dict.fromkeys(TRACEPOINT_ATTACH_POINTS, self.tracepoint)}
        probe0_offered = self.send in PROBE0_MODES and not offers["zero_window_probe"][self.send]
        modes["zero_window_probe"] = self.send if probe0_offered else "unavailable"
        return modes


def tracepoint_refusal(offers: Offers, mode: str) -> str | None:
    """Why the kernel cannot attach every tracepoint attach point in `mode`, or None."""
    reasons = [offers[point][mode] for point in TRACEPOINT_ATTACH_POINTS if offers[point][mode]]
    return reasons[0] if reasons else None


def best_send_mode(offers: Offers) -> str | None:
    return next((mode for mode in SEND_MODES if offers["send"][mode] is None), None)


def best_tracepoint_mode(offers: Offers) -> str:
    """What the loader's `auto` should pick: tp_btf when every tracepoint attach point takes it."""
    return "tp_btf" if tracepoint_refusal(offers, "tp_btf") is None else "raw_tp"


def plan_combos(offers: Offers) -> list[Combo]:
    combos: list[Combo] = []
    for send in SEND_MODES:
        tracepoint = FLAVOUR_PARTNER[send]
        if tracepoint_refusal(offers, tracepoint):
            tracepoint = next(m for m in TRACEPOINT_MODES if m != tracepoint)
        reason = offers["send"][send] or tracepoint_refusal(offers, tracepoint)
        combos.append(Combo(send, tracepoint, reason))
    covered = {c.tracepoint for c in combos if c.unavailable is None}
    best = best_send_mode(offers)
    for tracepoint in TRACEPOINT_MODES:
        if best and tracepoint not in covered and tracepoint_refusal(offers, tracepoint) is None:
            combos.append(Combo(best, tracepoint, None))
    return combos
