"""Copy-on-write clones of file ranges (`FICLONERANGE`): a checkpoint of disk-resident state that costs no
writes and no space until training changes the swap file. XFS (reflink=1, the default) and Btrfs support
it; elsewhere (ext4, tmpfs, another file system than the swap file's) the call fails and the caller copies.
"""

from __future__ import annotations

import fcntl
import struct

FICLONERANGE = 0x4020940D  # _IOW(0x94, 13, struct file_clone_range)
BLOCK = 4096  # clone ranges must start and end on file-system blocks (4 KiB on XFS and Btrfs by default)


def clone_range(src_fd: int, src_offset: int, nbytes: int, dst_fd: int, dst_offset: int) -> bool:
    """Make dst[dst_offset:+nbytes] share src[src_offset:+nbytes]'s blocks; False when not supported.
    Offsets and nbytes must be multiples of BLOCK."""
    if nbytes == 0:
        return True
    if (src_offset | dst_offset | nbytes) % BLOCK:
        return False
    try:
        fcntl.ioctl(dst_fd, FICLONERANGE, struct.pack("qQQQ", src_fd, src_offset, nbytes, dst_offset))
    except OSError:
        return False
    return True
