"""Async file I/O for swapping tensors to disk: io_uring, kernel AIO, a thread pool, or aiofiles."""

from offload.io.async_io import AsyncIO
from offload.io.backend import IOBackend, parse_backend
from offload.io.future import IOFuture
from offload.io.probe import available_native_backends, choose_backend
from offload.io.swap_file import SwapFile

__all__ = ["AsyncIO", "IOBackend", "IOFuture", "SwapFile", "available_native_backends", "choose_backend", "parse_backend"]
