"""scripts/bootstrap.sh stops at the first failing step, naming the command and showing its
message, instead of passing and leaving an environment that fails later on import.

No package is installed: pip runs without any index or wheel folder (``PIP_NO_INDEX``, no
config file), so the step under test fails at once with pip's own message.
"""
import os
import site
import subprocess
import sys

from fairseq_cli_utils import REPO

BOOTSTRAP = REPO / "scripts" / "bootstrap.sh"


def offline_env(tmp_path, venv, constraints=()):
    """pip without index, wheel folder or config file; optional constraints."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    wheels = tmp_path / "no-wheels"
    wheels.mkdir(exist_ok=True)
    e.update(VENV=str(venv), PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1",
             PIP_FIND_LINKS=str(wheels), PIP_DISABLE_PIP_VERSION_CHECK="1",
             OMP_NUM_THREADS="1")
    if constraints:
        c = tmp_path / "constraints.txt"
        c.write_text("".join(line + "\n" for line in constraints))
        e["PIP_CONSTRAINT"] = str(c)
    return e


def bootstrap(e):
    return subprocess.run(["bash", str(BOOTSTRAP)], cwd=REPO, env=e, capture_output=True,
                          text=True, timeout=300)


def test_failed_package_install_stops_bootstrap(tmp_path):
    """The last step (this package with its extras) used to end in `| grep -v torchaudio ||
    true`, which passed whatever pip did. Here torch, fairseq and the pins are present (the
    test's own site-packages), the extras cannot be installed, and the script fails with
    pip's command and message and writes no stamp."""
    venv = tmp_path / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    shared = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    (shared / "shared.pth").write_text(site.getsitepackages()[0] + "\n")
    proc = bootstrap(offline_env(tmp_path, venv, constraints=["matplotlib==0.0.1"]))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "bootstrap: fairseq present" in proc.stdout  # the earlier steps ran and passed
    assert "bootstrap: error: this command failed (exit status 1):" in proc.stderr, out
    assert (f"{venv}/bin/python -m pip --disable-pip-version-check install "
            "--no-build-isolation -e .\\[") in proc.stderr, out
    # pip's message, naming what conflicts
    assert "ResolutionImpossible" in proc.stderr and "matplotlib==0.0.1" in proc.stderr, out
    assert "bootstrap: done" not in out
    assert not (venv / ".bootstrap-stamp").exists()


def test_failed_torch_install_stops_bootstrap_in_a_fresh_venv(tmp_path):
    """A fresh VENV: the venv is created, torch cannot be installed, the script stops right
    there with the pip command and pip's message."""
    venv = tmp_path / "fresh"
    proc = bootstrap(offline_env(tmp_path, venv))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert f"bootstrap: creating virtual environment {venv}" in proc.stdout
    assert "bootstrap: installing torch==2.13.0" in proc.stdout
    assert (f"bootstrap: error: this command failed (exit status 1):\n  {venv}/bin/python -m pip "
            "--disable-pip-version-check install torch==2.13.0\n") in proc.stderr, out
    assert "No matching distribution found for torch==2.13.0" in proc.stderr
    assert "bootstrap: installing fairseq" not in out  # nothing after the failed step
    assert not (venv / ".bootstrap-stamp").exists()
