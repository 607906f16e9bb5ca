"""A thin, typed ctypes layer over the system libbpf (libbpf1 on Debian/Ubuntu, libbpf on RHEL).

Only the calls kvwatch uses are declared. Functions that fail return NULL or a negative errno;
`check_ptr` and `check_rc` turn that into `BpfError` with the OS's explanation. libbpf's own
log lines go to the `kvwatch.libbpf` logger, so verifier output is not lost.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
from ctypes import (
    CFUNCTYPE,
    POINTER,
    c_bool,
    c_char_p,
    c_int,
    c_size_t,
    c_uint,
    c_uint32,
    c_void_p,
)
from typing import Any

from kvwatch.errors import BpfError, PrivilegeError

log = logging.getLogger("kvwatch.libbpf")

LIBBPF_NAMES = ("libbpf.so.1", "libbpf.so.0", "libbpf.so")
BTF_KIND_STRUCT = 4
BTF_KIND_TYPEDEF = 8
BTF_KIND_DATASEC = 15

PrintFn = CFUNCTYPE(c_int, c_int, c_char_p, c_void_p)
RingBufferSampleFn = CFUNCTYPE(c_int, c_void_p, c_void_p, c_size_t)


class BtfType(ctypes.Structure):
    """struct btf_type: name offset, info (kind and vlen), size or type id."""

    _fields_ = [("name_off", c_uint32), ("info", c_uint32), ("size_or_type", c_uint32)]

    @property
    def kind(self) -> int:
        return int(self.info >> 24) & 0x1F

    @property
    def vlen(self) -> int:
        return int(self.info) & 0xFFFF


class BtfMember(ctypes.Structure):
    """struct btf_member (follows a struct's btf_type); offset is in bits."""

    _fields_ = [("name_off", c_uint32), ("type", c_uint32), ("offset", c_uint32)]


class BtfVarSecinfo(ctypes.Structure):
    """struct btf_var_secinfo (follows a DATASEC's btf_type)."""

    _fields_ = [("type", c_uint32), ("offset", c_uint32), ("size", c_uint32)]


def _load_library() -> ctypes.CDLL:
    names = list(LIBBPF_NAMES)
    found = ctypes.util.find_library("bpf")
    if found:
        names.append(found)
    for name in names:
        try:
            return ctypes.CDLL(name, use_errno=True)
        except OSError:
            continue
    raise PrivilegeError(
        "libbpf is not installed (looked for libbpf.so.1)",
        "install the libbpf1 package (Debian/Ubuntu) or libbpf (RHEL/Fedora)",
    )


_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "libbpf_major_version": (c_uint32, []),
    "libbpf_minor_version": (c_uint32, []),
    "libbpf_set_print": (c_void_p, [PrintFn]),
    "libbpf_num_possible_cpus": (c_int, []),
    "bpf_object__open_file": (c_void_p, [c_char_p, c_void_p]),
    "bpf_object__load": (c_int, [c_void_p]),
    "bpf_object__close": (None, [c_void_p]),
    "bpf_object__btf": (c_void_p, [c_void_p]),
    "bpf_object__find_program_by_name": (c_void_p, [c_void_p, c_char_p]),
    "bpf_object__find_map_by_name": (c_void_p, [c_void_p, c_char_p]),
    "bpf_object__next_program": (c_void_p, [c_void_p, c_void_p]),
    "bpf_program__name": (c_char_p, [c_void_p]),
    "bpf_program__set_autoload": (c_int, [c_void_p, c_bool]),
    "bpf_program__autoload": (c_bool, [c_void_p]),
    "bpf_program__fd": (c_int, [c_void_p]),
    "bpf_program__attach": (c_void_p, [c_void_p]),
    "bpf_link__destroy": (c_int, [c_void_p]),
    "bpf_link__fd": (c_int, [c_void_p]),
    "bpf_program__attach_iter": (c_void_p, [c_void_p, c_void_p]),
    "bpf_iter_create": (c_int, [c_int]),
    "bpf_map__fd": (c_int, [c_void_p]),
    "bpf_map__set_max_entries": (c_int, [c_void_p, c_uint32]),
    "bpf_map__initial_value": (c_void_p, [c_void_p, POINTER(c_size_t)]),
    "bpf_map_lookup_elem": (c_int, [c_int, c_void_p, c_void_p]),
    "bpf_map_get_next_key": (c_int, [c_int, c_void_p, c_void_p]),
    "bpf_map_lookup_batch": (
        c_int,
        [c_int, c_void_p, c_void_p, c_void_p, c_void_p, POINTER(c_uint32), c_void_p],
    ),
    "bpf_obj_get_info_by_fd": (c_int, [c_int, c_void_p, POINTER(c_uint32)]),
    "ring_buffer__new": (c_void_p, [c_int, RingBufferSampleFn, c_void_p, c_void_p]),
    "ring_buffer__poll": (c_int, [c_void_p, c_int]),
    "ring_buffer__consume": (c_int, [c_void_p]),
    "ring_buffer__epoll_fd": (c_int, [c_void_p]),
    "ring_buffer__free": (None, [c_void_p]),
    "btf__parse": (c_void_p, [c_char_p, c_void_p]),
    "btf__load_vmlinux_btf": (c_void_p, []),
    "btf__free": (None, [c_void_p]),
    "btf__find_by_name_kind": (c_int, [c_void_p, c_char_p, c_uint]),
    "btf__type_by_id": (POINTER(BtfType), [c_void_p, c_uint32]),
    "btf__name_by_offset": (c_char_p, [c_void_p, c_uint32]),
}


class Libbpf:
    """The loaded library with its function signatures declared. One per process."""

    def __init__(self) -> None:
        self.lib = _load_library()
        for name, (restype, argtypes) in _SIGNATURES.items():
            func = getattr(self.lib, name)
            func.restype = restype
            func.argtypes = argtypes
        self._print_fn = PrintFn(_forward_print)
        self.lib.libbpf_set_print(self._print_fn)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lib, name)

    @property
    def version(self) -> str:
        return f"{self.lib.libbpf_major_version()}.{self.lib.libbpf_minor_version()}"


_LIBC = ctypes.CDLL(None)
_LIBC.vsnprintf.argtypes = [c_char_p, c_size_t, c_char_p, c_void_p]


def _forward_print(_level: int, fmt: bytes, args: int) -> int:
    buffer = ctypes.create_string_buffer(1 << 16)
    _LIBC.vsnprintf(buffer, len(buffer), fmt, args)
    text = buffer.value.decode(errors="replace").rstrip()
    # The loader summarises failures itself; libbpf's detail (verifier logs) is for -v.
    log.debug("%s", text)
    return 0


_instance: Libbpf | None = None


def libbpf() -> Libbpf:
    """The process-wide binding, loaded on first use."""
    global _instance  # noqa: PLW0603 - one binding per process, created lazily
    if _instance is None:
        _instance = Libbpf()
    return _instance


def os_error_text(code: int) -> str:
    code = abs(code)
    return f"{errno.errorcode.get(code, str(code))}: {os.strerror(code)}"


def check_ptr(pointer: int | None, what: str) -> int:
    """Returns a non-NULL pointer or raises BpfError with errno's explanation."""
    if not pointer:
        raise BpfError(f"{what} failed ({os_error_text(ctypes.get_errno())})", _hint())
    return pointer


def check_rc(rc: int, what: str) -> int:
    """Returns a non-negative result or raises BpfError; libbpf returns -errno."""
    if rc < 0:
        code = -rc if rc != -1 else ctypes.get_errno()
        raise BpfError(f"{what} failed ({os_error_text(code)})", _hint(code))
    return rc


def privilege_hint() -> str:
    return "run as root, or grant CAP_BPF, CAP_PERFMON and CAP_NET_ADMIN (`kvwatch doctor`)"


def _hint(code: int = 0) -> str:
    if os.geteuid() != 0 or code in (errno.EPERM, errno.EACCES):
        return privilege_hint()
    return "`kvwatch doctor` lists what this kernel supports; -v shows libbpf's log"
