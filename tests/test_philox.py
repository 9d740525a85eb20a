"""Dropout masks drawn on the device (``hpcpar.nn.philox``, Philox4x32-10), under the transfer guard:
Random123's known answers, the same draws whichever part of a batch, a sequence or the heads a
rank holds, uniform draws, and no host copy."""
import numpy as np
import pytest

from hpcpar import guard
from hpcpar.autograd import Tensor
from hpcpar.guard import xp
from hpcpar.nn import DropoutKey, dropout_key
from hpcpar.nn.dropout_keys import keyed_uniform
from hpcpar.nn.layers import Dropout, HeadDropout
from hpcpar.nn.philox import philox4x32

# Random123's kat_vectors for philox4x32_10: (counter, key, output)
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.fixture(autouse=True)
def fresh_stats():
    guard.stats.reset()
    yield


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_known_answers_on_ints_host_arrays_and_device_arrays(counter, key, expected):
    assert philox4x32(counter, key) == expected
    for module in (np, xp):
        words = philox4x32(tuple(module.full(3, c, dtype=module.uint64) for c in counter), key)
        assert [guard.asnumpy(w).tolist() if module is xp else w.tolist() for w in words] == [[e] * 3 for e in expected]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_device_draws_are_the_same_whichever_samples_and_rows_a_rank_holds(dtype):
    """A dp replica's or micro-batch's samples, a sequence-parallel rank's rows: each is the
    matching part of the whole batch's draws (odd sizes, so that runs start inside Philox blocks)."""
    words, per_sample = (7, 3, 2), (13, 5)
    whole = guard.asnumpy(keyed_uniform(words, per_sample, range(0, 9), None, dtype, xp))
    assert whole.shape == (9, 13, 5) and whole.dtype == dtype
    for samples in (range(0, 4), range(4, 9), range(3, 4)):
        part = keyed_uniform(words, per_sample, samples, None, dtype, xp)
        np.testing.assert_array_equal(guard.asnumpy(part), whole[samples.start:samples.stop])
    for samples, rows in ((range(0, 9), range(0, 7)), (range(2, 6), range(7, 13)), (range(5, 6), range(3, 4))):
        part = keyed_uniform(words, per_sample, samples, rows, dtype, xp)
        np.testing.assert_array_equal(guard.asnumpy(part), whole[samples.start:samples.stop, rows.start:rows.stop])
    other = guard.asnumpy(keyed_uniform((7, 4, 2), per_sample, range(0, 9), None, dtype, xp))  # the next step
    assert not np.any(other == whole)
    assert guard.stats.to_device == 0  # drawn where they are used


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_device_draws_are_uniform(dtype):
    """2**16 draws: the mean, and 16 equal bins by chi-squared (15 degrees of freedom: 37.7 is the
    0.1 % tail; the seed is fixed, so the test cannot flake)."""
    draws = guard.asnumpy(keyed_uniform((1, 0, 0), (1 << 16,), range(0, 1), None, dtype, xp)).ravel()
    assert draws.min() >= 0.0 and draws.max() < 1.0
    assert abs(draws.mean() - 0.5) < 0.005
    counts = np.bincount((draws * 16).astype(int), minlength=16)
    expected = draws.size / 16
    assert ((counts - expected) ** 2 / expected).sum() < 37.7
    assert len(np.unique(draws)) > 0.99 * draws.size


def test_dropout_on_the_device_drops_per_sample_whatever_the_split():
    """A batch of 8 through ``Dropout`` equals its two halves with their keys (a dp split or two
    micro-batches), with no host copy; about p of the elements are dropped."""
    layer = Dropout(0.25, seed=3, site=1)
    x = Tensor(xp.asarray(np.ones((8, 16, 32), dtype=np.float32)))
    guard.stats.reset()
    with dropout_key(DropoutKey(5)):
        whole = guard.asnumpy(layer(x).data)
    halves = []
    for first in (0, 4):
        with dropout_key(DropoutKey(5, first)):
            halves.append(guard.asnumpy(layer(Tensor(x.data[first:first + 4])).data))
    np.testing.assert_array_equal(np.concatenate(halves), whole)
    assert abs((whole == 0).mean() - 0.25) < 0.02
    assert set(np.unique(whole)) == {0.0, np.float32(1 / 0.75)}
    assert guard.stats.to_device == 0


def test_head_dropout_on_the_device_is_the_same_whichever_heads_a_rank_holds():
    """Four heads' masks equal those of two tp ranks holding two heads each."""
    key = DropoutKey(2, 6)
    with dropout_key(key):
        every = guard.asnumpy(HeadDropout(0.1, range(0, 4), seed=9, site=2)(3, 8, np.float64, xp))
        split = [guard.asnumpy(HeadDropout(0.1, heads, seed=9, site=2)(3, 8, np.float64, xp))
                 for heads in (range(0, 2), range(2, 4))]
    np.testing.assert_array_equal(np.concatenate(split, axis=1), every)
    assert every.shape == (3, 4, 8, 8) and every.dtype == np.float64
    assert guard.stats.to_device == 0
