"""Independent computations of Admin's profiled omegas, shared by the profiling tests
(tests/test_profiling.py, tests/test_profiling_fairseq.py).

* eval mode: forward hooks on the attention/FFN/LayerNorm modules (not on the residual
  modules the implementation hooks), ``numpy.var`` over the real-token positions and the
  ratio recurrence written out again here;
* clinic mode: Transformer-Clinic's profiling pass written out again as a loop over the
  layers (fairseq's sub-modules in training mode, the same RNG draws in the same order), each
  omega applied by hand as the loop reaches it, ``numpy.var`` of ``x * omega`` and of the
  dropped-out branch over the whole tensor, padding included; several "ranks" run in
  lockstep, each with its own RNG stream, for the data-parallel check.
"""
import math

import numpy as np
import torch


from fairseq_admin_pos import profiling
from fairseq_admin_pos.models import admin_profile

# fixed omegas (the default with profiling is a trainable vector): training leaves the
# profiled values as they are, so the checks below read them after training too
PROFILE = ["--admin-init", "profile", "--admin-omega", "buffer"]
EVAL = PROFILE + ["--admin-profile-mode", "eval"]
CLINIC = PROFILE + ["--admin-profile-mode", "clinic"]
DROPOUTS = ["--dropout", "0.3", "--attention-dropout", "0.1", "--activation-dropout", "0.1"]


def first_batches(task, n=1, max_tokens=200, seed=1):
    """The first n batches of epoch 1, batched like fairseq-train (multiple of 8 sentences)."""
    task.load_dataset("train")
    itr = task.get_batch_iterator(task.dataset("train"), max_tokens=max_tokens, seed=seed,
                                  required_batch_size_multiple=8,
                                  disable_iterator_cache=True).next_epoch_itr(shuffle=True)
    out = []
    for sample in itr:
        out.append(sample["net_input"])
        if len(out) == n:
            return out
    raise AssertionError("not enough batches")


def reference_omegas(model, net_inputs, include_padding=False):
    """Eval mode. Shortcuts and branches captured from the sub-modules *around* each
    residual call (layer inputs, attention/fc2 outputs, LayerNorm outputs), variances with
    numpy (float64, ddof=0, over real-token positions unless include_padding), recurrence
    ratio_1 = 1, omega_i = ratio_i, ratio_{i+1} = sqrt(omega_i^2 Var[x] + Var[f])."""
    captured = {"encoder": [], "decoder": []}
    handles = []

    def grab(stack, kind, pre=False):
        def hook(mod, args, out=None):
            t = args[0] if pre else (out[0] if isinstance(out, tuple) else out)
            captured[stack].append((kind, t.detach().double().numpy().copy()))
        return hook

    for layer in model.encoder.layers:
        handles.append(layer.register_forward_pre_hook(grab("encoder", "x", pre=True)))
        handles.append(layer.self_attn.register_forward_hook(grab("encoder", "f")))
        handles.append(layer.self_attn_layer_norm.register_forward_hook(grab("encoder", "x")))
        handles.append(layer.fc2.register_forward_hook(grab("encoder", "f")))
    for layer in model.decoder.layers:
        handles.append(layer.register_forward_pre_hook(grab("decoder", "x", pre=True)))
        handles.append(layer.self_attn.register_forward_hook(grab("decoder", "f")))
        handles.append(layer.self_attn_layer_norm.register_forward_hook(grab("decoder", "x")))
        handles.append(layer.encoder_attn.register_forward_hook(grab("decoder", "f")))
        handles.append(layer.encoder_attn_layer_norm.register_forward_hook(grab("decoder", "x")))
        handles.append(layer.fc2.register_forward_hook(grab("decoder", "f")))

    per_batch = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for n in net_inputs:
                for k in captured:
                    captured[k] = []
                enc = model.encoder(n["src_tokens"], src_lengths=n["src_lengths"])
                model.decoder(n["prev_output_tokens"], encoder_out=enc, features_only=True)
                masks = {
                    "encoder": (n["src_tokens"] != model.encoder.padding_idx).numpy(),
                    "decoder": (n["prev_output_tokens"] != model.decoder.padding_idx).numpy(),
                }
                per_batch.append(({k: list(v) for k, v in captured.items()}, masks))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()

    omegas = {}
    for stack in ("encoder", "decoder"):
        # shortcuts in execution order: each layer's input, then the LayerNorm outputs that
        # feed the next sub-layer of the same layer (the FFN's LN output is the next input)
        n_sub = len(getattr(model, stack).layers) * (2 if stack == "encoder" else 3)
        shortcut_vals, branch_vals = [[] for _ in range(n_sub)], [[] for _ in range(n_sub)]
        for seq, masks in per_batch:
            xs = [t for kind, t in seq[stack] if kind == "x"]
            fs = [t for kind, t in seq[stack] if kind == "f"]
            assert len(xs) == len(fs) == n_sub
            for i, (x, f) in enumerate(zip(xs, fs)):
                mask = masks[stack].T  # (T, B), fairseq activations are (T, B, C)
                if include_padding:
                    shortcut_vals[i].append(x.reshape(-1))
                    branch_vals[i].append(f.reshape(-1))
                else:
                    shortcut_vals[i].append(x[mask].reshape(-1))
                    branch_vals[i].append(f[mask].reshape(-1))
        ratio, out = 1.0, []
        for xv, fv in zip(shortcut_vals, branch_vals):
            out.append(ratio)
            ratio = math.sqrt(ratio ** 2 * np.var(np.concatenate(xv)) + np.var(np.concatenate(fv)))
        omegas[stack] = out
    return omegas


def clinic_layers(model, n):
    """Transformer-Clinic's profiling forward (its ``transformer_layer.py``), written out:
    fairseq's sub-modules called in the order and with the arguments of the model's own
    forward (so the dropout draws are the same), a generator that yields ``(stack, x, f)``
    at every residual sub-layer - ``x`` the shortcut, ``f`` the dropped-out branch output,
    ``(T, B, C)`` - and takes back the omega that the sub-layer applies:
    ``LN(x * omega + f)``. The model must be in training mode."""
    enc, dec = model.encoder, model.decoder
    src, prev = n["src_tokens"], n["prev_output_tokens"]
    pad = src.eq(enc.padding_idx)
    x, _ = enc.forward_embedding(src)
    x = (x * (1 - pad.unsqueeze(-1).type_as(x))).transpose(0, 1)
    src_pad = pad if pad.any() else None
    for layer in enc.layers:
        f, _ = layer.self_attn(query=x, key=x, value=x, key_padding_mask=src_pad,
                               need_weights=False, attn_mask=None)
        f = layer.dropout_module(f)
        omega = yield "encoder", x, f
        x = layer.self_attn_layer_norm(x * omega + f)
        f = layer.fc2(layer.activation_dropout_module(layer.activation_fn(layer.fc1(x))))
        f = layer.dropout_module(f)
        omega = yield "encoder", x, f
        x = layer.final_layer_norm(x * omega + f)
    enc_out = x
    y = dec.embed_scale * dec.embed_tokens(prev) + dec.embed_positions(prev)
    y = dec.dropout_module(y).transpose(0, 1)
    tgt_pad = prev.eq(dec.padding_idx)
    tgt_pad = tgt_pad if tgt_pad.any() else None
    last = len(dec.layers) - 1
    for i, layer in enumerate(dec.layers):
        f, _ = layer.self_attn(query=y, key=y, value=y, key_padding_mask=tgt_pad,
                               incremental_state=None, need_weights=False,
                               attn_mask=dec.buffered_future_mask(y))
        f = layer.dropout_module(f)
        omega = yield "decoder", y, f
        y = layer.self_attn_layer_norm(y * omega + f)
        f, _ = layer.encoder_attn(query=y, key=enc_out, value=enc_out, key_padding_mask=src_pad,
                                  incremental_state=None, static_kv=True,
                                  need_weights=i == last, need_head_weights=i == last)
        f = layer.dropout_module(f)
        omega = yield "decoder", y, f
        y = layer.encoder_attn_layer_norm(y * omega + f)
        f = layer.fc2(layer.activation_dropout_module(layer.activation_fn(layer.fc1(y))))
        f = layer.dropout_module(f)
        omega = yield "decoder", y, f
        y = layer.final_layer_norm(y * omega + f)


def clinic_reference(model, net_inputs, seeds):
    """Clinic's in-pass omegas. Each batch is one "rank" with its own RNG stream seeded with
    its seed; the ranks run in lockstep, and at each sub-layer ``omega = ratio`` and
    ``ratio = sqrt(np.var(x * omega) + np.var(f))`` over all ranks' flattened tensors
    (padding included). One batch and one seed: Clinic's single-GPU profiling run."""
    was_training = model.training
    model.train()
    outer = torch.get_rng_state()
    try:
        with torch.no_grad():
            states, gens = [], []
            for n, seed in zip(net_inputs, seeds):
                torch.manual_seed(seed)
                states.append(torch.get_rng_state())
                gens.append(clinic_layers(model, n))

            def step(r, value):
                torch.set_rng_state(states[r])
                try:
                    item = next(gens[r]) if value is None else gens[r].send(value)
                except StopIteration:
                    item = None
                states[r] = torch.get_rng_state()
                return item

            ratio = {"encoder": 1.0, "decoder": 1.0}
            omegas = {"encoder": [], "decoder": []}
            items = [step(r, None) for r in range(len(gens))]
            while items[0] is not None:
                stack = items[0][0]
                assert all(it[0] == stack for it in items)
                omega = ratio[stack]
                xs = np.concatenate([(x * omega).double().numpy().reshape(-1) for _, x, _ in items])
                fs = np.concatenate([f.double().numpy().reshape(-1) for _, _, f in items])
                ratio[stack] = math.sqrt(np.var(xs) + np.var(fs))
                omegas[stack].append(omega)
                items = [step(r, omega) for r in range(len(gens))]
    finally:
        torch.set_rng_state(outer)
        model.train(was_training)
    return omegas


def model_omegas(model):
    return {k: profiling.get_omegas(v) for k, v in admin_profile.residual_stacks(model).items()}


def assert_close(a, b, tol):
    assert set(a) == set(b)
    for k in a:
        assert len(a[k]) == len(b[k]), k
        np.testing.assert_allclose(a[k], b[k], rtol=tol, atol=tol, err_msg=k)



SMALL = ["--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim",
         "32", "--decoder-ffn-embed-dim", "32", "--encoder-layers", "2", "--decoder-layers", "2"]
