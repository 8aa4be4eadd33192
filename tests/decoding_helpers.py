"""Helpers shared by tests/test_decoding.py and tests/test_sessions.py (tiny vocab 128; ids 0..2 are specials)."""

import pytest
import torch

PAD = 0


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine two OpenMP threads competing
    with another process run 10-100x slower; one thread keeps the suite's time predictable."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rand_ids(*shape, seed=1):
    """Random non-special token ids ``[*shape]`` from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, shape, generator=g)


@torch.no_grad()
def logits_nocache(model, ids, mask=None):
    """The reference: logits of a full forward without any cache."""
    return model(ids, attention_mask=mask, use_cache=False).logits


def gen(model, ids, **kw):
    """``model.generate`` greedy by default, with our pad id."""
    kw.setdefault("do_sample", False)
    kw.setdefault("pad_token_id", PAD)
    with torch.no_grad():
        return model.generate(ids, **kw)
