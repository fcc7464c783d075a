"""What only the disk store has: `write(fill, cloned)` seals, and does not write, what a checkpoint's
copy-on-write clone already put in the swap file; `swap_sections` says where the record's sections are."""

from __future__ import annotations

import os

import pytest
import torch

from tests.unit.state.stores import open_store, pattern, read_all


def _fill(salts):
    def fill(start, stop, views):
        for section, view in enumerate(views):
            view.copy_(pattern(start, stop, section, salts[section]))
    return fill


@pytest.mark.parametrize("cloned_master", [6600, 3000, 0])  # all of it, an unaligned head, none
def test_write_writes_only_what_the_clone_did_not_put_in_the_file(tmp_path, cloned_master):
    with open_store("disk", str(tmp_path)) as case:
        n = case.group.trainable_numel
        assert cloned_master <= n
        case.store.write(_fill((1.0, 1.0, 1.0)))
        before = case.swap.bytes_written
        # the master section's first `cloned_master` elements are already in the file (the same values)
        case.store.write(_fill((1.0, 2.0, 2.0)), cloned=(cloned_master, 0, 0))
        assert case.swap.bytes_written - before == 4 * (2 * n + n - cloned_master)
        _spans, master, exp_avg, exp_avg_sq = read_all(case.store)  # verified against the seals
        assert torch.equal(master, pattern(0, n, 0, 1.0))
        assert torch.equal(exp_avg, pattern(0, n, 1, 2.0)) and torch.equal(exp_avg_sq, pattern(0, n, 2, 2.0))


def test_swap_sections_are_the_records_three_sections_in_its_swap_file(tmp_path):
    with open_store("disk", str(tmp_path)) as case:
        n = case.group.trainable_numel
        case.store.write(_fill((1.0, 2.0, 3.0)))
        fd, offsets, nbytes, itemsizes = case.store.swap_sections()
        assert nbytes == (4 * n,) * 3 and itemsizes == (4, 4, 4)
        for section, offset in enumerate(offsets):
            assert offset % 4096 == 0
            raw = torch.frombuffer(bytearray(os.pread(fd, nbytes[section], offset)), dtype=torch.float32)
            assert torch.equal(raw, pattern(0, n, section, 1.0 + section))
