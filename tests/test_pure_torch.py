"""The building blocks stay pure torch: their files import no fairseq (DEVELOPERS guide), so
they can be copied into another code base or used without fairseq installed; the package
still registers everything with fairseq, once, whichever module is imported first."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "fairseq_admin_pos"
PURE = ("admin", "collapse", "errors", "norms", "placements", "positional", "profile_files",
        "profile_stats", "profiling", "schemes")
STDLIB = {"__future__", "contextlib", "json", "math", "numbers", "os", "tempfile", "typing"}


def imported_modules(path: Path) -> set:
    """Every module named by an ``import`` / ``from ... import`` anywhere in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


@pytest.mark.parametrize("name", PURE)
def test_building_block_imports_only_torch_and_stdlib(name):
    allowed_own = {f"fairseq_admin_pos.{m}" for m in PURE}
    bad = {m for m in imported_modules(PKG / f"{name}.py")
           if m.split(".")[0] not in STDLIB | {"torch"} and m not in allowed_own}
    assert not bad, f"{name}.py imports {sorted(bad)}"


def test_the_check_sees_a_fairseq_import():
    glue = PKG / "models" / "layers.py"
    assert any(m.startswith("fairseq.") for m in imported_modules(glue))


# --------------------------------------------------------------------------------------- #
# the same promise at run time: importing the blocks imports no fairseq, and they work where
# fairseq is not installed; the package still registers everything with fairseq
# --------------------------------------------------------------------------------------- #
REPO = PKG.parent

# exercises each block with numbers checked against a hand computation
USE_BLOCKS = r"""
import math, sys, torch
import fairseq_admin_pos.admin as admin_torch
from fairseq_admin_pos.positional import SinusoidalEmbeddings
from fairseq_admin_pos.profiling import omegas_from_variances
from fairseq_admin_pos.schemes import deepnorm_constants, ReZeroResidual

omega = admin_torch.calculate_init(36)  # sqrt((N+1)/ln(N+1) - 1)
assert abs(omega - math.sqrt(37 / math.log(37) - 1)) < 1e-12, omega
res = admin_torch.as_module(36)
torch.manual_seed(0)
x, f = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
# float32 rounding of omega * x, as absolute error: about 1% of unseeded draws gave a sum so
# close to 0 that allclose's default atol 1e-8 failed (a flaky run in CI)
assert torch.allclose(res(x, f), x * omega + f, rtol=1e-6, atol=1e-6)
table = SinusoidalEmbeddings(16, 8)(torch.tensor([3]))
assert abs(table[0, 0].item() - math.sin(3.0)) < 1e-6
assert omegas_from_variances([1.0, 1.0], [3.0, 5.0]) == [1.0, 2.0]
assert abs(deepnorm_constants(6, 6).encoder_alpha - 0.81 * (6 ** 4 * 6) ** (1 / 16)) < 1e-12
assert torch.equal(ReZeroResidual()(x, f), x)
from fairseq_admin_pos.collapse import token_cosine
# two real tokens at 60 degrees and a pad: cosine 1/2
pair = torch.tensor([[[1.0, 0.0]], [[0.5, math.sqrt(3) / 2]], [[9.0, 9.0]]])
assert abs(token_cosine(pair, torch.tensor([[False, False, True]])).item() - 0.5) < 1e-6
print("fairseq imported:", "fairseq" in sys.modules)
"""

# makes `import fairseq` fail as it does where fairseq is not installed
BLOCK_FAIRSEQ = r"""
import importlib.abc, sys
class NoFairseq(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fairseq", "fairseq_cli"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoFairseq())
"""


def run_python(code: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_blocks_work_where_fairseq_is_not_installed():
    out = run_python(BLOCK_FAIRSEQ + USE_BLOCKS).stdout
    assert "fairseq imported: False" in out


def test_blocks_do_not_import_the_installed_fairseq():
    out = run_python(USE_BLOCKS).stdout
    assert "fairseq imported: False" in out


def test_without_fairseq_registration_names_the_missing_package():
    code = BLOCK_FAIRSEQ + (
        "import fairseq_admin_pos\n"
        "try:\n    fairseq_admin_pos.register()\n"
        "except ModuleNotFoundError as e:\n    print('missing', e.name)\n"
    )
    assert "missing fairseq" in run_python(code).stdout


# every wrapper registration installs, with how many times it is wrapped (1: installed once)
REGISTERED = r"""
import functools
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.optim import OPTIMIZER_REGISTRY
from fairseq import checkpoint_utils, options
from fairseq.data import data_utils
from fairseq.trainer import Trainer

def depth(f):
    # the plugin's wrappers in the chain (fairseq decorates some methods itself)
    n = 0
    while f is not None:
        code = getattr(f, "__code__", None)  # functools.wraps copies __module__, not this
        n += code is not None and "fairseq_admin_pos" in code.co_filename
        f = getattr(f, "__wrapped__", None)
    return n

print(sorted(a for a in ARCH_MODEL_REGISTRY if a.startswith('admin_transformer'))[:2],
      'radam' in OPTIMIZER_REGISTRY,
      [depth(f) for f in (options.parse_args_and_arch, data_utils.batch_by_size,
                          Trainer.train_step, Trainer.get_train_iterator,
                          Trainer.clip_grad_norm, Trainer.set_num_updates,
                          checkpoint_utils.load_model_ensemble_and_task)])
"""
EXPECTED = "['admin_transformer', 'admin_transformer_iwslt_de_en'] True [1, 1, 1, 1, 1, 1, 1]"


@pytest.mark.parametrize("first", [
    "import fairseq_admin_pos",
    "import fairseq",
    # a glue or fix module first: its own fairseq import triggers the registration, which
    # must not trip over the module being imported
    "import fairseq_admin_pos.fairseq_fixes.cli_help",
    "import fairseq_admin_pos.fairseq_fixes.batching_fix",
    "import fairseq_admin_pos.models.admin_transformer",
    "import fairseq_admin_pos.optim.radam",
    "import fairseq_admin_pos.cli.analyze",
])
def test_registration_happens_once_whatever_is_imported_first(first):
    code = f"{first}\nimport fairseq_admin_pos, fairseq\nfairseq_admin_pos.register()\n"
    assert EXPECTED in run_python(code + REGISTERED).stdout


def test_a_failed_registration_is_retried():
    code = (
        "import fairseq_admin_pos\n"
        "from fairseq_admin_pos.fairseq_fixes import cli_help\n"
        "install = cli_help.install\n"
        "def broken():\n    raise RuntimeError('interrupted')\n"
        "cli_help.install = broken\n"
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n    import fairseq\n"
        "print('first:', [str(w.message) for w in caught if 'fairseq_admin_pos' in str(w.message)])\n"
        "cli_help.install = install\n"
        "fairseq_admin_pos.register()\n"
    )
    out = run_python(code + REGISTERED).stdout
    assert "registering with fairseq failed (RuntimeError: interrupted)" in out
    assert EXPECTED in out
