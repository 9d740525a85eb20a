"""Evaluation during and after training measures the model that trains, in every layout."""
import pytest

import hpcpar
from hpcpar.runtime.context import single_process
from hpcpar.train.build import build
from hpcpar.train.config_load import load_job
from hpcpar.train.evaluate import evaluate
from hpcpar.train.loop import train_one_step
from hpcpar.train.validate import validate

CNN = ["model.kind=cnn", "data.kind=digits", "data.batch_size=16", "train.precision=fp64",
       "parallel.micro_batches=2", "optimizer.lr=0.05", "train.steps=3"]


def trained_and_evaluated(ctx, pp: int) -> dict:
    job = validate(load_job(None, CNN + [f"parallel.pp={pp}"]), ctx.world_size)
    run = build(job, ctx)
    for step in range(job.train.steps):
        train_one_step(run, step)
    return evaluate(run)


@pytest.mark.mpi(min_size=2)
def test_a_cnn_pipeline_is_evaluated_on_its_trained_stages(world):
    """A pipeline rank holds the whole CNN but trains only its stages' layers: evaluating that
    whole model (as evaluate once did) gave the loss and accuracy of a half-trained model."""
    pipelined = trained_and_evaluated(hpcpar.init(pp=world.Get_size(), device="cpu"), world.Get_size())
    one_process = trained_and_evaluated(single_process(), 1)
    assert pipelined["val_accuracy"] == one_process["val_accuracy"]
    assert pipelined["val_loss"] == pytest.approx(one_process["val_loss"], rel=1e-9)
