"""The pages a pinned buffer is registered on (cuda; checked here without a device).

torch asks the driver whether a tensor is pinned with its storage's first byte, so the
registered range must start there: the first GPU run found ``is_pinned()`` False for every
buffer, registered from a page boundary inside a storage that began before it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from zenflow.engine.accelerator.cuda import PAGE, page_aligned_empty


@pytest.mark.parametrize(
    "shape,dtype",
    [((3, 5), torch.float32), ((1_000_003,), torch.bfloat16), ((0,), torch.float32),
     ((7, PAGE), torch.uint8), ((2, 3, 4), torch.int64)],
)  # fmt: skip
def test_the_storage_starts_on_a_page_and_owns_whole_pages(shape, dtype):
    t = page_aligned_empty(shape, dtype)
    st = t.untyped_storage()
    assert tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous()
    assert st.data_ptr() % PAGE == 0 and t.data_ptr() in (st.data_ptr(), 0)  # 0: empty
    need = t.numel() * t.element_size()
    assert st.nbytes() == max(PAGE, -(-need // PAGE) * PAGE)  # whole pages, no more
    t.fill_(3)
    assert int(t.double().sum()) == 3 * t.numel()


def test_a_view_keeps_the_pages_and_the_last_one_frees_them():
    t = page_aligned_empty((1 << 20,), torch.float32)
    freed = []
    weakref.finalize(t.untyped_storage(), freed.append, True)
    view = t[7:]
    del t
    gc.collect()
    assert not freed and view.untyped_storage().data_ptr() % PAGE == 0
    view.fill_(1.0)
    del view
    gc.collect()
    assert freed == [True]
