"""The fairseq functions the plugin replaces (fairseq_admin_pos/fairseq_fixes/patches.py)
against the installed fairseq.

A fairseq upgrade that moves or renames one of them fails here with one line naming the
module and attribute. A new interpreter (``tests/fairseq_patch_probe.py``) imports fairseq
and its tools, finds every target, imports the plugin the way ``--user-dir`` does, and
checks that each target is now the plugin's replacement wrapping fairseq's own and that no
other attribute of fairseq, hydra or ``sys`` changed. The same probe runs on a copy of the
table with one target renamed, one moved to another module, one left out and one credited to
the wrong function, and must report exactly those four.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fairseq_admin_pos.fairseq_fixes import batching_fix, cli_help, patches
from fairseq_cli_utils import REPO, TINY_MODEL, USER_DIR, env
from model_utils import build_trainer

TABLE = REPO / "fairseq_admin_pos" / "fairseq_fixes" / "patches.py"
DOCS = REPO / "docs" / "fairseq-fixes.md"

#: a copy of the table (loaded by the probe after the real one, as _admin_patch_table1)
#: with four mistakes a fairseq upgrade or a forgotten entry would make
CHANGED_TABLE = '''
import dataclasses
import sys

real = sys.modules["_admin_patch_table0"]
resolve, PatchTargetMissing = real.resolve, real.PatchTargetMissing
CHANGES = {
    "fairseq.data.data_utils.batch_by_size": dict(attribute="batch_by_size_v2"),
    "fairseq.trainer.Trainer.set_num_updates": dict(module="fairseq.training.trainer"),
    "fairseq.options.parse_args_and_arch": dict(
        patched_by="fairseq_admin_pos.fairseq_fixes.batching_fix.install"),
}
PATCHES = tuple(dataclasses.replace(p, **CHANGES.get(p.target, {})) for p in real.PATCHES
                if p.target != "fairseq.trainer.Trainer.clip_grad_norm")
'''


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    changed = tmp_path_factory.mktemp("patch_table") / "changed_table.py"
    changed.write_text(CHANGED_TABLE)
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "fairseq_patch_probe.py"), USER_DIR, str(TABLE),
         str(changed)], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    real, changed = json.loads(proc.stdout.splitlines()[-1])
    return dict(real=real, changed=changed)


def test_every_target_exists_in_the_installed_fairseq(reports):
    assert not reports["real"]["missing"], "\n".join(reports["real"]["missing"])


def test_after_import_each_target_is_the_plugins_replacement(reports):
    assert not reports["real"]["not_replaced"], "\n".join(reports["real"]["not_replaced"])


def test_the_plugin_replaces_nothing_the_table_does_not_list(reports):
    assert not reports["real"]["unlisted"], "\n".join(reports["real"]["unlisted"])


def test_a_renamed_or_moved_target_is_reported_by_module_and_attribute(reports):
    missing = reports["changed"]["missing"]
    assert len(missing) == 2
    renamed, moved = missing
    assert renamed.startswith("fairseq_admin_pos replaces fairseq.data.data_utils."
                              "batch_by_size_v2 (")
    assert "but fairseq.data.data_utils has no attribute batch_by_size_v2 (fairseq " in renamed
    assert "in fairseq_admin_pos.fairseq_fixes.batching_fix.install" in renamed
    assert moved.startswith("fairseq_admin_pos replaces fairseq.training.trainer."
                            "Trainer.set_num_updates (")
    assert "but module fairseq.training.trainer cannot be imported" in moved
    assert all(line.endswith(f"see {patches.DOCS}") and "\n" not in line for line in missing)


def test_a_target_left_out_or_credited_wrongly_is_reported(reports):
    unlisted = reports["changed"]["unlisted"]
    # the two the changed table no longer names under their real place, and the one it drops
    assert sorted(line.split(":")[0] for line in unlisted) == [
        "fairseq.data.data_utils.batch_by_size", "fairseq.trainer.Trainer.clip_grad_norm",
        "fairseq.trainer.Trainer.set_num_updates"]
    (wrong,) = reports["changed"]["not_replaced"]
    assert wrong.startswith("fairseq.options.parse_args_and_arch: after importing the plugin "
                            "it is not the replacement made in "
                            "fairseq_admin_pos.fairseq_fixes.batching_fix.install")


#: per-trainer replacements: the precision whose trainer makes them, and the object found
#: under the target's name on that trainer's optimizer
TRAINER_CASES = {
    "fairseq.optim.fairseq_optimizer.FairseqOptimizer.optimizer": (None, "ForeachAdam"),
    "fairseq.optim.fairseq_optimizer.FairseqOptimizer.clip_grad_norm":
        (None, "_fast_clip_grad_norm"),
    "fairseq.optim.fp16_optimizer.FP16Optimizer._sync_fp16_grads_to_fp32":
        ("bf16", "grads_to_fp32"),
    "fairseq.optim.fp16_optimizer.FP16Optimizer._sync_fp32_params_to_fp16":
        ("bf16", "params_to_fp16"),
}


def _name_of(value) -> str:
    value = getattr(value, "func", value)  # a partial
    return getattr(value, "__name__", type(value).__name__)


def test_each_per_trainer_replacement_is_made_on_the_plugins_trainers(tiny_data):
    listed = {p.target: p for p in patches.PATCHES if p.when == "trainer"}
    assert sorted(listed) == sorted(TRAINER_CASES)
    trainers = {}
    for target, (precision, expected) in TRAINER_CASES.items():
        if precision not in trainers:
            trainers[precision] = build_trainer(tiny_data, TINY_MODEL, precision=precision)
        optimizer = trainers[precision].optimizer
        owner, name = patches.resolve(listed[target])
        assert isinstance(optimizer, owner), target
        value = getattr(optimizer, name)
        module = getattr(value, "func", value).__module__
        assert (_name_of(value), module) == \
            (expected, listed[target].patched_by.rsplit(".", 1)[0]), target


def test_wrap_refuses_a_missing_target_in_one_line(monkeypatch):
    gone = patches.Patch("fairseq.data.data_utils", "batch_by_size_old", "a test entry",
                         f"{batching_fix.__name__}.install")
    monkeypatch.setitem(patches.BY_TARGET, gone.target, gone)
    with pytest.raises(patches.PatchTargetMissing) as caught:
        patches.wrap(gone.target, lambda f: f)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("fairseq_admin_pos replaces fairseq.data.data_utils."
                              "batch_by_size_old (a test entry; in "
                              "fairseq_admin_pos.fairseq_fixes.batching_fix.install), but "
                              "fairseq.data.data_utils has no attribute batch_by_size_old")


def test_installing_twice_wraps_once():
    from fairseq import options

    first = options.parse_args_and_arch
    assert getattr(first, patches.MARKER) == "fairseq.options.parse_args_and_arch"
    cli_help.install()
    assert options.parse_args_and_arch is first


def test_the_docs_list_every_target():
    text = DOCS.read_text()
    missing = [p.target for p in patches.PATCHES
               if f"`{p.module}` | `{p.attribute}`" not in text]
    assert not missing, f"{DOCS.name} does not list: {', '.join(missing)}"
