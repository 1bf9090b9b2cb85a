"""``--admin-compile layers`` (``fairseq_admin_pos/speed/compile.py``): training with the
compiled layers gives eager's losses within float tolerance, checkpoints move between
compiled and eager runs, and everything outside training runs eagerly.

The model has 2 encoder layers and 1 decoder layer. TorchInductor compiles one graph per
layer class and input layout, and each layout of this model is trained against eager: the
encoder's first layer reads the transposed embedding output and its second a contiguous
tensor; the decoder's self-attention mask is either the whole of fairseq's cached future
mask or a slice of it, depending on the batch's target length. A second decoder layer
would add two more graphs of the layouts above (about a third of the test's time, most of
it C++ compilation) and check nothing new.
"""
import pytest
import torch
from fairseq.logging import metrics

from fairseq_cli_utils import TINY_MODEL
from model_utils import build, build_trainer

#: TINY_MODEL with one decoder layer (the later flag wins)
MODEL = TINY_MODEL + ["--decoder-layers", "1"]
COMPILE_UPDATES = 50
# fused kernels round differently: measured over 50 updates, losses within 3e-5 relative
COMPILE_RTOL = 2e-4


def _train_losses(trainer, batches, updates, start=0):
    losses = []
    for i in range(start, start + updates):
        with metrics.aggregate(new_root=True) as agg:
            trainer.train_step([batches[i % len(batches)]])
        losses.append(float(agg["loss"].avg))
    return losses


@pytest.mark.slow  # compiles (C++) four graphs: the file is handed to a worker first
def test_compiled_layers_train_like_eager_and_share_checkpoints(tiny_data, tmp_path):
    """50 updates with --admin-compile layers give eager's losses within float tolerance
    (dropout on: the same random numbers), and a checkpoint of the compiled run resumes in
    an eager run (and the other way) with the same weights and losses."""
    extra = MODEL + ["--admin-omega", "parameter", "--dropout", "0.1",
                     "--save-dir", str(tmp_path)]
    eager = build_trainer(tiny_data, extra)
    batches = list(eager.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False))
    # batches of different target lengths: both layouts of the decoder's mask are trained
    assert len({b["target"].size(1) for b in batches}) > 1
    reference = _train_losses(eager, batches, COMPILE_UPDATES)

    compiled = build_trainer(tiny_data, extra + ["--admin-compile", "layers"])
    model = compiled.get_model()
    assert (len(model.encoder.layers), len(model.decoder.layers)) == (2, 1)
    assert all(layer.admin_compiled for layer in [*model.encoder.layers, *model.decoder.layers])
    half = COMPILE_UPDATES // 2
    first = _train_losses(compiled, batches, half)
    assert first == pytest.approx(reference[:half], rel=COMPILE_RTOL)
    assert model.state_dict().keys() == eager.get_model().state_dict().keys()
    compiled.consolidate_optimizer()  # what checkpoint_utils.save_checkpoint does first
    compiled.save_checkpoint(str(tmp_path / "compiled.pt"), {})

    resumed = build_trainer(tiny_data, extra)  # eager, from the compiled run's checkpoint
    resumed.load_checkpoint(str(tmp_path / "compiled.pt"))
    for k, v in model.state_dict().items():
        if torch.is_tensor(v):
            assert torch.equal(v, resumed.get_model().state_dict()[k]), k
    rest = _train_losses(resumed, batches, COMPILE_UPDATES - half, start=half)
    assert first + rest == pytest.approx(reference, rel=COMPILE_RTOL)
    # and the compiled trainer goes on from where it was, still close to eager
    more = _train_losses(compiled, batches, COMPILE_UPDATES - half, start=half)
    assert more == pytest.approx(reference[half:], rel=COMPILE_RTOL)


def test_compiled_layers_run_eagerly_outside_training(tiny_data):
    from fairseq_admin_pos.speed.compile import compiled_forward

    model, _, _ = build(tiny_data, "admin_transformer", MODEL + ["--admin-compile", "layers"])
    layer = model.encoder.layers[0]
    model.train()
    assert compiled_forward(layer) is not None
    with torch.no_grad():
        assert compiled_forward(layer) is None
    model.eval()
    assert compiled_forward(layer) is None
    plain, _, _ = build(tiny_data, "admin_transformer", MODEL)
    plain.train()
    assert compiled_forward(plain.encoder.layers[0]) is None


def test_compile_refuses_activation_checkpointing(tiny_data):
    with pytest.raises(ValueError, match="--admin-compile layers cannot be combined with "
                                         "--checkpoint-activations"):
        build(tiny_data, "admin_transformer",
              MODEL + ["--admin-compile", "layers", "--checkpoint-activations"])
