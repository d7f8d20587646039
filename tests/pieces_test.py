"""jaxcomp.ops.pieces (a vector kept as its parts) and how the update writes its parts
(jaxcomp.optim.packing) against the joined vector."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp.ops import flat, pieces
from jaxcomp.ops.pieces import Pieces
from jaxcomp.optim import packing
from jaxcomp.optim.stages import error_feedback

RNG = np.random.default_rng(0)


def _parts(*sizes):
    return Pieces([jnp.asarray(RNG.standard_normal(n), jnp.float32) for n in sizes])


def test_a_vector_in_parts_is_its_joined_vector():
    v = _parts(3, 0, 5)
    joined = np.concatenate([np.asarray(p) for p in v.parts])
    assert v.sizes == [3, 0, 5] and v.size == 8 and v.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(v.joined()), joined)
    np.testing.assert_array_equal(np.asarray(pieces.joined(v)), joined)
    np.testing.assert_array_equal(np.asarray(pieces.each(jnp.abs, v).joined()), np.abs(joined))
    back = Pieces.split(jnp.asarray(joined), [3, 0, 5])
    assert back.sizes == [3, 0, 5]
    np.testing.assert_array_equal(np.asarray(back.joined()), joined)


def test_split_names_sizes_that_do_not_add_up():
    with pytest.raises(ValueError, match=r"sizes \[2, 2\] add up to 4, not 5"):
        Pieces.split(jnp.zeros(5), [2, 2])


def test_energies_of_the_parts_are_the_vectors():
    v = _parts(7, 1000, 3)
    v = Pieces([v.parts[0].at[2].set(jnp.inf), *v.parts[1:]])
    got, want = pieces.energies(v, 0.5), flat.energies(v.joined(), 0.5)
    assert float(got[0]) == float(want[0]) == float("inf")
    np.testing.assert_allclose(np.asarray(got)[1:], np.asarray(want)[1:], rtol=1e-6)


def test_the_residual_of_parts_is_the_joined_residual():
    fed = jnp.asarray(RNG.standard_normal(9), jnp.float32)
    sent = _parts(4, 5)
    residual = error_feedback.remaining(fed, sent, False)
    assert isinstance(residual, Pieces) and residual.sizes == [4, 5]
    np.testing.assert_array_equal(np.asarray(residual.joined()), np.asarray(fed - sent.joined()))


def test_parts_of_whole_leaves_are_written_as_the_joined_total():
    """Each part holds whole leaves (a leaf without values goes with the part before it): the
    updates and the kept residuals are the joined vector's, skipped or not."""
    leaves = [jnp.zeros(s) for s in [(2, 2), (3,), (0, 4), (5,), (0,)]]
    positions = list(range(len(leaves)))
    total = _parts(7, 5)
    for skipped in (None, jnp.bool_(False), jnp.bool_(True)):
        out, want = [None] * 5, [None] * 5
        packing.write(out, leaves, positions, total, 0.5, skipped)
        packing.write(want, leaves, positions, total.joined(), 0.5, skipped)
        for a, b in zip(out, want):
            assert a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        old = [jnp.ones(leaf.shape) for leaf in leaves]
        new, new_joined = [None] * 5, [None] * 5
        packing.keep(new, old, leaves, positions, total, skipped)
        packing.keep(new_joined, old, leaves, positions, total.joined(), skipped)
        for a, b in zip(new, new_joined):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_parts_that_cut_a_leaf_are_refused():
    leaves = [jnp.zeros(4), jnp.zeros(4)]
    with pytest.raises(ValueError, match="does not hold whole leaves"):
        packing.write([None, None], leaves, [0, 1], _parts(3, 5), 1.0, None)
    with pytest.raises(ValueError, match="hold 1 of the group's 2 leaves"):
        packing.write([None, None], leaves, [0, 1], _parts(4), 1.0, None)
