"""Expert load from the metrics file's ``moe`` entry: the progress line's words, TensorBoard's
numbers, and the warning when one expert keeps more than ``model.moe.load_warning`` times its
even share in every record for 50 steps."""
import pytest

from hpcpar.train.expert_load import LoadWatch, loads, scalars, summary


def entry(tokens, steps=10, dropped=None):
    return {"blocks": list(range(1, 2 * len(tokens), 2)), "experts": len(tokens[0]), "tokens": tokens,
            "dropped": dropped or [0.0] * len(tokens), "aux_loss": 2.25, "z_loss": 0.5, "steps": steps}


def test_the_load_is_each_experts_share_over_the_even_share():
    moe = entry([[10, 10, 10, 10], [40, 0, 0, 0]])
    assert loads(moe).tolist() == [[1, 1, 1, 1], [4, 0, 0, 0]]
    assert loads(entry([[0, 0]])).tolist() == [[0, 0]]  # a block that routed nothing is not a division by zero
    assert summary(entry([[10, 30], [20, 20]], dropped=[0.02, 0.04])) == "experts 1.50x  drop 3.0%  aux 2.25 z 0.5"


def test_tensorboard_gets_flat_numbers_per_block():
    assert scalars(entry([[10, 30], [20, 20]], dropped=[0.25, 0.0])) == {
        "moe/aux_loss": 2.25, "moe/z_loss": 0.5, "moe/block1/max_load": 1.5, "moe/block1/dropped": 0.25,
        "moe/block3/max_load": 1.0, "moe/block3/dropped": 0.0}


def test_the_warning_comes_once_after_fifty_steps_above_the_limit_and_again_after_a_break():
    watch = LoadWatch(limit=2.0)
    hot, even = entry([[10, 10, 10, 10], [50, 10, 10, 10]]), entry([[10, 10, 10, 10], [25, 25, 15, 15]])
    said = {step: watch.update(step, hot) for step in (10, 20, 30, 40)}  # steps 1-40: above, not yet 50
    assert not any(said.values())
    line, = watch.update(50, hot)  # steps 1-50
    assert line.startswith("expert load: block 3's expert 0 took 62% of the block's routed tokens at step 50 "
                           "(2.50x the even share 1/4), above model.moe.load_warning = 2 in every record since step 1")
    assert watch.update(60, hot) == []  # once per stretch
    assert watch.update(70, even) == []  # the stretch ends
    assert [watch.update(step, hot) for step in range(80, 120, 10)] == [[], [], [], []]  # steps 71-110
    assert "since step 71" in watch.update(120, hot)[0]  # steps 71-120: 50


@pytest.mark.parametrize("interval", [1, 25, 100])
def test_the_stretch_counts_the_steps_each_record_covers(interval):
    watch = LoadWatch(limit=1.5)
    hot = entry([[90, 10]], steps=interval)
    warned = [step for step in range(interval, 201, interval) if watch.update(step, hot)]
    assert warned == [max(50, interval)]
