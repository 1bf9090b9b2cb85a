"""Tests for fairseq_admin_pos.admin (pure torch, CPU, seeded)."""
import copy
import os
import pickle
import re
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
import torch
import torch.nn as nn

import fairseq_admin_pos.admin as admin_torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADMIN_PATH = os.path.join(REPO_ROOT, "fairseq_admin_pos", "admin.py")
POSITIONAL_PATH = os.path.join(REPO_ROOT, "fairseq_admin_pos", "positional.py")

NS = [1, 2, 12, 18, 36, 200, 10 ** 6]
SCALES = ["O(logn)", "default", "O(1)", "O(n)"]

# real `python -O` run of both pure-torch modules, started early (see python_O_run)
_PYTHON_O_SCRIPT = textwrap.dedent(f"""
    import importlib.util, sys, torch

    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    admin = load("admin_standalone", {ADMIN_PATH!r})
    pos = load("positional_standalone", {POSITIONAL_PATH!r})
    if any(m == "fairseq" or m.startswith("fairseq.") for m in sys.modules):
        print("fairseq imported")
        sys.exit(2)
    checks = [
        (lambda: admin.calculate_init(0), ValueError),
        (lambda: admin.calculate_init(12, "bogus"), ValueError),
        (lambda: admin.OmegaResidual(1.0, as_parameter=True), ValueError),
        (lambda: admin.as_buffer("net", "omega", 12), TypeError),
        (lambda: pos.SinusoidalEmbeddings(0, 8), ValueError),
        (lambda: pos.SinusoidalEmbeddings(4, 8, padding_idx=4), ValueError),
        (lambda: pos.PositionalEmbeddings(4, 8, padding_idx=-5), ValueError),
        (lambda: pos.SinusoidalEmbeddings(4, 8)(torch.tensor([4])), IndexError),
        (lambda: pos.PositionalEmbeddings(4, 8)(torch.tensor([-1])), IndexError),
    ]
    for i, (fn, exc) in enumerate(checks):
        try:
            fn()
        except exc:
            pass
        else:
            print("no error in check", i)
            sys.exit(3)
    print("ok", sys.flags.optimize)
""")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module", autouse=True)
def python_O_run():
    proc = subprocess.Popen([sys.executable, "-O", "-c", _PYTHON_O_SCRIPT],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def reference_omega(n, scale):
    """Independent closed form (numpy, natural log written via log2)."""
    n = np.float64(n)
    if scale in ("O(logn)", "default"):
        omega2 = (n + 1.0) / (np.log2(n + 1.0) * np.log(2.0)) - 1.0
    elif scale == "O(1)":
        omega2 = n
    else:
        omega2 = np.float64(1.0)
    return float(np.sqrt(omega2))


# --------------------------------------------------------------------------- #
# calculate_init
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("scale", SCALES)
def test_calculate_init_matches_formula(n, scale):
    value = admin_torch.calculate_init(n, scale)
    assert type(value) is float
    assert value == pytest.approx(reference_omega(n, scale), rel=1e-12)
    assert value >= 1.0


@pytest.mark.parametrize("n", NS)
def test_calculate_init_default_is_logn(n):
    assert admin_torch.calculate_init(n) == admin_torch.calculate_init(n, "O(logn)")
    assert admin_torch.calculate_init(n, "default") == admin_torch.calculate_init(n, "O(logn)")


@pytest.mark.parametrize("n,expected,tol", [(12, 2.017, 5e-4), (18, 2.335, 5e-4), (36, 3.04, 5e-3)])
def test_calculate_init_anchor_values(n, expected, tol):
    assert abs(admin_torch.calculate_init(n) - expected) < tol


def test_calculate_init_hand_values():
    # N=1: 2/ln 2 - 1 = 1.8853900817779268 -> sqrt = 1.3730951...
    assert admin_torch.calculate_init(1) == pytest.approx(1.3730950737, abs=1e-9)
    assert admin_torch.calculate_init(16, "O(1)") == 4.0
    assert admin_torch.calculate_init(7, "O(n)") == 1.0
    # O(logn) grows much more slowly than O(1)
    assert admin_torch.calculate_init(10 ** 6) < admin_torch.calculate_init(10 ** 6, "O(1)") / 3


def test_calculate_init_accepts_numpy_int():
    assert admin_torch.calculate_init(np.int64(12)) == admin_torch.calculate_init(12)


@pytest.mark.parametrize("bad", [0, -1, -12, True, False, 2.0, 2.5, "12", None, np.float64(3.0)])
def test_calculate_init_bad_num_res_layers(bad):
    with pytest.raises(ValueError, match="num_res_layers") as info:
        admin_torch.calculate_init(bad)
    assert "positive int" in str(info.value)


@pytest.mark.parametrize("bad", ["O(log n)", "o(1)", "O(N)", "", None, 1, ["O(1)"]])
def test_calculate_init_bad_scale(bad):
    with pytest.raises(ValueError, match="output_change_scale") as info:
        admin_torch.calculate_init(12, bad)
    message = str(info.value)
    for valid in ("O(logn)", "default", "O(1)", "O(n)"):
        assert valid in message


# --------------------------------------------------------------------------- #
# OmegaResidual / as_module
# --------------------------------------------------------------------------- #
def test_buffer_form_shape_and_registration():
    m = admin_torch.as_module(12)
    assert m.omega.shape == (1,)
    assert m.omega.dtype == torch.float32
    assert not m.omega.requires_grad
    assert list(dict(m.named_buffers())) == ["omega"]
    assert list(m.parameters()) == []
    assert list(m.state_dict()) == ["omega"]
    assert m.omega.item() == pytest.approx(reference_omega(12, "O(logn)"), rel=1e-6)


def test_parameter_form_shape_and_registration():
    m = admin_torch.as_module(18, "O(1)", as_parameter=True, embed_dim=6)
    assert isinstance(m.omega, nn.Parameter)
    assert m.omega.shape == (6,)
    assert m.omega.requires_grad
    assert list(dict(m.named_buffers())) == []
    assert list(m.state_dict()) == ["omega"]
    torch.testing.assert_close(m.omega.detach(), torch.full((6,), 18 ** 0.5))


def test_init_value_accepts_numbers_and_one_element_tensor():
    for value in (2, 2.0, np.float32(2.0), torch.tensor(2.0), torch.tensor([2.0])):
        m = admin_torch.OmegaResidual(value)
        assert torch.equal(m.omega, torch.tensor([2.0]))


def test_embed_dim_ignored_for_buffer_form():
    m = admin_torch.OmegaResidual(2.0, as_parameter=False, embed_dim=7)
    assert m.omega.shape == (1,)


@pytest.mark.parametrize("as_parameter", [False, True])
@pytest.mark.parametrize("shape", [(4,), (3, 4), (2, 3, 4)])
def test_forward_values(as_parameter, shape):
    m = admin_torch.as_module(36, as_parameter=as_parameter, embed_dim=4)
    x, f = torch.randn(shape), torch.randn(shape)
    omega = admin_torch.calculate_init(36)
    out = m(x, f)
    assert out.shape == shape
    torch.testing.assert_close(out, x * omega + f)
    torch.testing.assert_close(m.forward_omega(x, f), x * omega + f)
    torch.testing.assert_close(m.forward_original(x, f), x + f)
    assert not torch.allclose(out, x + f)


def test_parameter_vector_is_elementwise():
    m = admin_torch.OmegaResidual(1.0, as_parameter=True, embed_dim=3)
    with torch.no_grad():
        m.omega.copy_(torch.tensor([1.0, 2.0, -3.0]))
    x, f = torch.ones(2, 3), torch.zeros(2, 3)
    torch.testing.assert_close(m(x, f), torch.tensor([[1.0, 2.0, -3.0]] * 2))


def test_gradient_reaches_omega_only_as_parameter():
    x = torch.randn(2, 5, 4, requires_grad=True)
    f = torch.randn(2, 5, 4)
    upstream = torch.randn(2, 5, 4)

    buf = admin_torch.as_module(12)
    (buf(x, f) * upstream).sum().backward()
    assert buf.omega.grad is None and not buf.omega.requires_grad
    torch.testing.assert_close(x.grad, upstream * admin_torch.calculate_init(12))

    x.grad = None
    par = admin_torch.as_module(12, as_parameter=True, embed_dim=4)
    (par(x, f) * upstream).sum().backward()
    expected = (x.detach() * upstream).sum(dim=(0, 1))
    torch.testing.assert_close(par.omega.grad, expected)
    torch.testing.assert_close(x.grad, upstream * admin_torch.calculate_init(12))


def _special_inputs(dtype):
    finfo = torch.finfo(dtype)
    x = torch.randn(64, 8).to(dtype) * 10
    f = torch.randn(64, 8).to(dtype) * 1e-3
    specials = torch.tensor(
        [0.0, -0.0, finfo.tiny / 4, -finfo.tiny / 2, finfo.max, -finfo.max,
         float("inf"), float("-inf")], dtype=torch.float64
    ).to(dtype)
    x[0] = specials
    f[0] = torch.tensor([-0.0, -0.0, finfo.tiny / 8, finfo.tiny, finfo.max, 1.0, 1.0, -1.0],
                        dtype=torch.float64).to(dtype)
    return x, f


def _bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else
                               torch.int32 if t.element_size() == 4 else torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("make", [
    lambda: admin_torch.OmegaResidual(1.0),
    lambda: admin_torch.as_module(12, "O(n)"),
    lambda: admin_torch.as_module(10 ** 6, "O(n)"),
])
def test_omega_one_buffer_is_bitwise_plain_residual(dtype, make):
    m = make().to(dtype)
    x, f = _special_inputs(dtype)
    out = m(x, f)
    ref = x + f
    assert out.dtype == ref.dtype == dtype
    assert torch.equal(_bits(out), _bits(ref))


def test_omega_one_module_float32_input_half_is_bitwise():
    # module left in float32, inputs in half: result dtype and bits as x + f_x
    m = admin_torch.as_module(4, "O(n)")
    x, f = _special_inputs(torch.float16)
    out = m(x, f)
    assert out.dtype == torch.float16
    assert torch.equal(_bits(out), _bits(x + f))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_buffer_omega_of_another_dtype_costs_no_cast_kernel(dtype):
    """A float32 omega with inputs of another dtype: one fused kernel, omega converted to the
    inputs' dtype on the fly (as ``omega.to(x.dtype)`` would round it)."""
    from dispatch_utils import OpRecorder

    m = admin_torch.as_module(36)
    x, f = torch.randn(5, 8).to(dtype), torch.randn(5, 8).to(dtype)
    with OpRecorder() as rec:
        out = m(x, f)
    assert rec.kernels() == ["aten.addcmul.default"]
    assert out.dtype == dtype
    assert torch.equal(out, torch.addcmul(f, x, m.omega.to(dtype)))


def test_state_loading_decides_behaviour():
    x, f = torch.randn(3, 4), torch.randn(3, 4)
    one = admin_torch.OmegaResidual(1.0)
    one.load_state_dict({"omega": torch.tensor([2.0])})
    torch.testing.assert_close(one(x, f), x * 2 + f)
    assert not torch.allclose(one(x, f), x + f)

    two = admin_torch.OmegaResidual(2.0)
    two.load_state_dict({"omega": torch.tensor([1.0])})
    assert torch.equal(two(x, f), x + f)

    # in-place modification is honoured too (no construction-time decision)
    with torch.no_grad():
        two.omega.fill_(3.0)
    torch.testing.assert_close(two(x, f), x * 3 + f)


@pytest.mark.parametrize("as_parameter", [False, True])
def test_state_dict_roundtrip_through_file(tmp_path, as_parameter):
    src = admin_torch.as_module(18, "O(1)", as_parameter=as_parameter, embed_dim=5)
    with torch.no_grad():
        src.omega.mul_(1.5)
    path = tmp_path / "omega.pt"
    torch.save(src.state_dict(), path)
    state = torch.load(path, weights_only=True)
    dst = admin_torch.as_module(2, "O(n)", as_parameter=as_parameter, embed_dim=5)
    dst.load_state_dict(state, strict=True)
    assert torch.equal(dst.omega, src.omega)
    x, f = torch.randn(2, 5), torch.randn(2, 5)
    assert torch.equal(dst(x, f), src(x, f))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("as_parameter", [False, True])
def test_dtype_following(dtype, as_parameter):
    m = admin_torch.as_module(12, as_parameter=as_parameter, embed_dim=4)
    convert = {torch.float16: m.half, torch.bfloat16: m.bfloat16, torch.float64: m.double}[dtype]
    convert()
    assert m.omega.dtype == dtype
    x, f = torch.randn(3, 4, dtype=dtype), torch.randn(3, 4, dtype=dtype)
    out = m(x, f)
    assert out.dtype == dtype
    omega = torch.tensor(admin_torch.calculate_init(12)).to(dtype)  # float32 value, converted
    # computed with one rounding (fused multiply-add), so compare with the exact value
    torch.testing.assert_close(out, (x.double() * omega.double() + f.double()).to(dtype))
    m.to(torch.float32)
    assert m.omega.dtype == torch.float32


def test_device_following_meta():
    m = admin_torch.as_module(12).to("meta")
    assert m.omega.device.type == "meta"
    p = admin_torch.as_module(12, as_parameter=True, embed_dim=3).to("meta")
    assert p.omega.device.type == "meta"


@pytest.mark.cuda
@pytest.mark.parametrize("as_parameter", [False, True])
def test_device_following_cuda(as_parameter):
    m = admin_torch.as_module(12, "O(n)", as_parameter=as_parameter, embed_dim=4).cuda()
    assert m.omega.is_cuda
    x, f = torch.randn(3, 4, device="cuda"), torch.randn(3, 4, device="cuda")
    assert torch.equal(m(x, f), x + f)


@pytest.mark.parametrize("as_parameter", [False, True])
def test_deepcopy_and_pickle(as_parameter):
    m = admin_torch.as_module(36, as_parameter=as_parameter, embed_dim=4)
    x, f = torch.randn(2, 4), torch.randn(2, 4)
    for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert "forward" not in vars(clone)
        assert torch.equal(clone(x, f), m(x, f))
        with torch.no_grad():
            clone.omega.fill_(1.0)
        assert torch.equal(clone(x, f), x + f)  # the copy follows its own omega
    assert not torch.equal(m(x, f), x + f)


def test_torch_compile_fullgraph_follows_current_omega():
    m = admin_torch.as_module(12, "O(n)")
    compiled = torch.compile(m, backend="eager", fullgraph=True)
    x, f = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(compiled(x, f), x + f)
    m.load_state_dict({"omega": torch.tensor([2.0])})
    torch.testing.assert_close(compiled(x, f), x * 2 + f)


def test_extra_repr():
    assert "init_value=2.01" in repr(admin_torch.as_module(12))
    assert "as_parameter=False" in repr(admin_torch.as_module(12))
    r = repr(admin_torch.as_module(12, as_parameter=True, embed_dim=8))
    assert "as_parameter=True" in r and "embed_dim=8" in r


@pytest.mark.parametrize("bad", [None, 0, -4, True, 2.5, "8"])
def test_parameter_form_requires_embed_dim(bad):
    with pytest.raises(ValueError, match="embed_dim"):
        admin_torch.OmegaResidual(2.0, as_parameter=True, embed_dim=bad)
    with pytest.raises(ValueError, match="embed_dim"):
        admin_torch.as_module(12, as_parameter=True, embed_dim=bad)
    with pytest.raises(ValueError, match="embed_dim"):
        admin_torch.as_parameter(nn.Module(), "omega", 12, bad)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "2", None, True, torch.tensor([1.0, 2.0])])
def test_bad_init_value(bad):
    with pytest.raises(ValueError, match="init_value"):
        admin_torch.OmegaResidual(bad)


def test_as_module_validates():
    with pytest.raises(ValueError, match="num_res_layers"):
        admin_torch.as_module(0)
    with pytest.raises(ValueError, match="output_change_scale"):
        admin_torch.as_module(12, "O(log(n))")


# --------------------------------------------------------------------------- #
# as_buffer / as_parameter
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("scale", SCALES)
def test_as_buffer(scale):
    net = nn.Linear(4, 4)
    admin_torch.as_buffer(net, "attn_omega", 24, scale)
    assert net.attn_omega.shape == (1,)
    assert not net.attn_omega.requires_grad
    assert "attn_omega" in net.state_dict()  # persistent
    assert "attn_omega" not in dict(net.named_parameters())
    assert net.attn_omega.item() == pytest.approx(reference_omega(24, scale), rel=1e-6)
    net.half()
    assert net.attn_omega.dtype == torch.float16


@pytest.mark.parametrize("scale", SCALES)
def test_as_parameter(scale):
    net = nn.Module()
    admin_torch.as_parameter(net, "ffn_omega", 30, 5, scale)
    assert isinstance(net.ffn_omega, nn.Parameter)
    assert net.ffn_omega.shape == (5,)
    torch.testing.assert_close(net.ffn_omega.detach(),
                               torch.full((5,), reference_omega(30, scale)))
    net.bfloat16()
    assert net.ffn_omega.dtype == torch.bfloat16


def test_helpers_follow_existing_network_dtype():
    net = nn.Linear(4, 4).double()
    admin_torch.as_buffer(net, "b", 12)
    admin_torch.as_parameter(net, "p", 12, 4)
    assert net.b.dtype == torch.float64 and net.p.dtype == torch.float64


@pytest.mark.parametrize("bad", [None, "net", object(), torch.zeros(1)])
def test_network_type_errors(bad):
    with pytest.raises(TypeError, match="torch.nn.Module"):
        admin_torch.as_buffer(bad, "omega", 12)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        admin_torch.as_parameter(bad, "omega", 12, 4)


def test_helpers_validate_before_registering():
    net = nn.Module()
    with pytest.raises(ValueError, match="num_res_layers"):
        admin_torch.as_buffer(net, "omega", 0)
    with pytest.raises(ValueError, match="output_change_scale"):
        admin_torch.as_parameter(net, "omega", 12, 4, "bogus")
    assert not hasattr(net, "omega")


def test_helpers_state_dict_roundtrip(tmp_path):
    def build():
        net = nn.Linear(4, 4)
        admin_torch.as_buffer(net, "b", 12)
        admin_torch.as_parameter(net, "p", 12, 4, "O(1)")
        return net

    src = build()
    with torch.no_grad():
        src.b.fill_(5.0)
        src.p.fill_(-1.0)
    torch.save(src.state_dict(), tmp_path / "net.pt")
    dst = build()
    dst.load_state_dict(torch.load(tmp_path / "net.pt", weights_only=True))
    assert dst.b.item() == 5.0 and torch.equal(dst.p, torch.full((4,), -1.0))


# --------------------------------------------------------------------------- #
# the seed's docstring examples
# --------------------------------------------------------------------------- #
CFG = types.SimpleNamespace(encoder_layers=3, embed_dim=8, num_heads=2, feedforward_dim=16)


class ModuleLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        num_layer = 2 * cfg.encoder_layers
        self.attn = nn.MultiheadAttention(cfg.embed_dim, cfg.num_heads)
        self.residual_attn = admin_torch.as_module(num_layer)
        self.ln_attn = nn.LayerNorm(cfg.embed_dim)
        self.ffn = nn.Sequential(nn.Linear(cfg.embed_dim, cfg.feedforward_dim), nn.ReLU(),
                                 nn.Linear(cfg.feedforward_dim, cfg.embed_dim))
        self.residual_ffn = admin_torch.as_module(num_layer)
        self.ln_ffn = nn.LayerNorm(cfg.embed_dim)

    def forward(self, x):
        f_x, _ = self.attn(x, x, x)
        x = self.ln_attn(self.residual_attn(x, f_x))
        f_x = self.ffn(x)
        return self.ln_ffn(self.residual_ffn(x, f_x))


class BufferLayer(ModuleLayer):
    def __init__(self, cfg):
        super().__init__(cfg)
        del self.residual_attn, self.residual_ffn
        admin_torch.as_buffer(self, "attn_omega", 2 * cfg.encoder_layers)
        admin_torch.as_buffer(self, "ffn_omega", 2 * cfg.encoder_layers)

    def forward(self, x):
        f_x, _ = self.attn(x, x, x)
        x = self.ln_attn(x * self.attn_omega + f_x)
        f_x = self.ffn(x)
        return self.ln_ffn(x * self.ffn_omega + f_x)


class ParameterLayer(BufferLayer):
    def __init__(self, cfg):
        super().__init__(cfg)
        del self.attn_omega, self.ffn_omega
        admin_torch.as_parameter(self, "attn_omega", 2 * cfg.encoder_layers, cfg.embed_dim)
        admin_torch.as_parameter(self, "ffn_omega", 2 * cfg.encoder_layers, cfg.embed_dim)


def _manual_forward(layer, x, omega):
    f_x, _ = layer.attn(x, x, x)
    x = nn.functional.layer_norm(x * omega + f_x, (CFG.embed_dim,),
                                 layer.ln_attn.weight, layer.ln_attn.bias)
    f_x = layer.ffn(x)
    return nn.functional.layer_norm(x * omega + f_x, (CFG.embed_dim,),
                                    layer.ln_ffn.weight, layer.ln_ffn.bias)


@pytest.mark.parametrize("cls", [ModuleLayer, BufferLayer, ParameterLayer])
def test_seed_examples_run(cls):
    torch.manual_seed(1)
    layer = cls(CFG).eval()
    x = torch.randn(5, 3, CFG.embed_dim)  # (time, batch, embed)
    y = layer(x)
    assert y.shape == (5, 3, CFG.embed_dim)
    omega = admin_torch.calculate_init(2 * CFG.encoder_layers)
    torch.testing.assert_close(y, _manual_forward(layer, x, omega))
    # and it differs from the plain Post-LN residual
    assert not torch.allclose(y, _manual_forward(layer, x, 1.0))
    n_params = sum(p.numel() for p in layer.parameters())
    n_base = sum(p.numel() for p in ModuleLayer(CFG).parameters())
    assert n_params == n_base + (2 * CFG.embed_dim if cls is ParameterLayer else 0)


def _code_blocks(doc):
    blocks = re.findall(r"\.\. code-block:: python\n\n(.*?)(?=\n    \S|\Z)", doc, flags=re.S)
    return [textwrap.dedent(b) for b in blocks]


@pytest.mark.parametrize("func", [admin_torch.as_module, admin_torch.as_buffer,
                                  admin_torch.as_parameter])
def test_docstring_examples_execute(func):
    blocks = _code_blocks(func.__doc__)
    assert len(blocks) == 1
    code = blocks[0]
    assert "import fairseq_admin_pos.admin as admin_torch" in code
    assert "nn.Linear(cfg.feedforward_dim, cfg.embed_dim)" in code
    assert "self.attn(x, x, x)" in code
    namespace = {}
    exec(compile(code, f"<{func.__name__} docstring>", "exec"), namespace)
    assert namespace["y"].shape == (5, 3, 16)


def test_calculate_init_doctest():
    import doctest
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    for test in finder.find(admin_torch.calculate_init, "calculate_init",
                            globs={"__name__": "doctest"}):
        runner.run(test)
    assert runner.failures == 0 and runner.tries >= 3


# --------------------------------------------------------------------------- #
# python -O and purity
# --------------------------------------------------------------------------- #
def _load_as_if_python_O(path, name):
    """Execute the module source compiled exactly as ``python -O`` would
    (asserts stripped), without importing the package ``__init__``."""
    with open(path) as fh:
        code = compile(fh.read(), path, "exec", optimize=1)
    module = types.ModuleType(name)
    module.__file__ = path
    exec(code, module.__dict__)
    return module


def test_optimize_really_strips_asserts():
    exec(compile("assert False", "<probe>", "exec", optimize=1), {})  # no AssertionError


def test_errors_survive_optimized_compile():
    admin = _load_as_if_python_O(ADMIN_PATH, "admin_optimized")
    checks = [
        (lambda: admin.calculate_init(0), ValueError, "num_res_layers"),
        (lambda: admin.calculate_init(-3), ValueError, "num_res_layers"),
        (lambda: admin.calculate_init(True), ValueError, "num_res_layers"),
        (lambda: admin.calculate_init(2.5), ValueError, "num_res_layers"),
        (lambda: admin.calculate_init(12, "bogus"), ValueError, "output_change_scale"),
        (lambda: admin.OmegaResidual(1.0, as_parameter=True), ValueError, "embed_dim"),
        (lambda: admin.as_buffer("net", "omega", 12), TypeError, "torch.nn.Module"),
        (lambda: admin.as_parameter(nn.Module(), "omega", 12, None), ValueError, "embed_dim"),
    ]
    for fn, exc, word in checks:
        with pytest.raises(exc, match=re.escape(word)):
            fn()


def test_python_O_subprocess_both_modules(python_O_run):
    """One real ``python -O`` run for admin.py and positional.py (loaded by
    path, so the fairseq-importing package __init__ is not executed): the
    validation errors still fire and fairseq is never imported.  The process
    is started at the beginning of this module (fixture) to overlap with the
    other tests."""
    stdout, stderr = python_O_run.communicate(timeout=120)
    assert python_O_run.returncode == 0, stdout + stderr
    assert stdout.strip().splitlines()[-1] == "ok 1"
