"""Keras's global seed generator, put back after a block that draws from it."""

import random

import keras

from tfmixprec._keras.settings import global_seeds_kept


def _draws():
    return keras.random.randint((4,), 0, 2**30).numpy().tolist()


def test_the_global_seed_generator_draws_what_it_would_have_drawn():
    _draws()  # the generator exists (Keras 3.12's set_random_seed leaves it as it is)
    with global_seeds_kept():
        inside = _draws()  # the block draws
    assert _draws() == inside  # and the draws after it are the ones it drew


def test_a_generator_the_block_created_is_created_again_after_it():
    """Where none existed, the block's first draw created one seeded from Python's `random`:
    after the block none exists, and `random` is where it was, so the next draw is the same."""
    keras.utils.set_random_seed(5)
    # Keras's global generator unset, as in a fresh process (put back at the end).
    from keras.src.backend.common import global_state

    kept = global_state.get_global_attribute("global_seed_generator")
    try:
        global_state.set_global_attribute("global_seed_generator", None)
        state = random.getstate()
        expected = _draws()
        global_state.set_global_attribute("global_seed_generator", None)
        random.setstate(state)
        with global_seeds_kept():
            assert _draws() == expected
        assert global_state.get_global_attribute("global_seed_generator") is None
        assert random.getstate() == state
        assert _draws() == expected
    finally:
        global_state.set_global_attribute("global_seed_generator", kept)
