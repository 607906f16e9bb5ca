"""Reads struct layouts and data-section offsets from a BTF blob (an object file's or the
kernel's), through libbpf."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

from kvwatch.collect.bpf.libbpf import (
    BTF_KIND_DATASEC,
    BTF_KIND_STRUCT,
    BtfMember,
    BtfType,
    BtfVarSecinfo,
    check_ptr,
    libbpf,
)
from kvwatch.errors import BpfError


@dataclass(frozen=True)
class StructLayout:
    """A struct's size and its members' byte offsets, in declaration order."""

    size: int
    members: tuple[tuple[str, int], ...]


def _type(btf: int, type_id: int) -> BtfType:
    found: BtfType = libbpf().btf__type_by_id(btf, type_id).contents
    return found


def _name(btf: int, offset: int) -> str:
    raw: bytes | None = libbpf().btf__name_by_offset(btf, offset)
    return raw.decode() if raw else ""


def _trailing(btf_type: BtfType, item: type[ctypes.Structure]) -> ctypes.Array[ctypes.Structure]:
    address = ctypes.addressof(btf_type) + ctypes.sizeof(BtfType)
    array_type = item * btf_type.vlen
    return array_type.from_address(address)


def _find(btf: int, name: str, kind: int) -> BtfType:
    type_id = libbpf().btf__find_by_name_kind(btf, name.encode(), kind)
    if type_id < 0:
        raise BpfError(f"BTF has no {name!r}", "rebuild the BPF object with `make bpf`")
    return _type(btf, type_id)


def struct_layout(btf: int, name: str) -> StructLayout:
    struct = _find(btf, name, BTF_KIND_STRUCT)
    members = tuple(
        (_name(btf, member.name_off), member.offset // 8) for member in _trailing(struct, BtfMember)
    )
    return StructLayout(size=struct.size_or_type, members=members)


def datasec_offset(btf: int, section: str, variable: str) -> tuple[int, int]:
    """(offset, size) of a global variable inside a data section such as .rodata."""
    datasec = _find(btf, section, BTF_KIND_DATASEC)
    for info in _trailing(datasec, BtfVarSecinfo):
        if _name(btf, _type(btf, info.type).name_off) == variable:
            return info.offset, info.size
    raise BpfError(f"{section} has no variable {variable!r}", "rebuild with `make bpf`")


class BtfFile:
    """BTF parsed from a file (ELF object or raw kernel BTF); closes with the context."""

    def __init__(self, path: Path) -> None:
        self.handle = check_ptr(libbpf().btf__parse(str(path).encode(), None), f"parse {path}")

    def __enter__(self) -> int:
        return self.handle

    def __exit__(self, *exc: object) -> None:
        libbpf().btf__free(self.handle)
