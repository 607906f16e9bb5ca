"""The Python mirror of bpf/kvwatch.h matches the compiled object's BTF, member by member."""

from __future__ import annotations

import ctypes

import pytest

from kvwatch.collect.bpf.btf import BtfFile, struct_layout
from kvwatch.collect.bpf.layout import MIRRORED_STRUCTS
from kvwatch.collect.bpf.loader import DEFAULT_OBJECT


@pytest.mark.bpf
@pytest.mark.parametrize("name", sorted(MIRRORED_STRUCTS))
def test_python_mirror_matches_object_btf(name: str) -> None:
    mirror = MIRRORED_STRUCTS[name]
    with BtfFile(DEFAULT_OBJECT) as btf:
        layout = struct_layout(btf, name)
    assert layout.size == ctypes.sizeof(mirror)
    python_members = tuple(
        (field_name, getattr(mirror, field_name).offset) for field_name, *_ in mirror._fields_
    )
    assert layout.members == python_members
