"""One service, two installations (issue 30): a node's service serves launchers and trainers
of its own code only. Another installation (a copy of the package with one line changed, as
another virtual environment or an older checkout would be) is refused at ``hold`` and at
``attach`` by name, with the remedy; ``tiered daemon status`` says which installation the
service runs from."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tiered.launch.cli import main as tiered
from tiered.service.identity import this_code
from tiered.service.paths import RUNTIME_ENV

from helpers import REPO, clean_env, own_service

TRY = """
import sys
from tiered.device import CpuAccelerator
from tiered.service import JobHold, Channel, ServiceError, ServiceSlabSource
folder, what = sys.argv[1], sys.argv[2]
try:
    if what == "hold":
        JobHold(folder, "other-code").end(clean=True)
    else:
        ServiceSlabSource(Channel.connect(folder), "other-code", 0, 1,
                          CpuAccelerator()).close(True)
except ServiceError as e:
    print(e)
    sys.exit(3)
"""


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with own_service(tmp_path_factory, dram=1 << 20) as folder:
        yield folder


@pytest.fixture(scope="module")
def other_installation(tmp_path_factory) -> str:
    """A copy of this package whose one module says one thing more."""
    root = tmp_path_factory.mktemp("other")
    shutil.copytree(REPO / "tiered", root / "tiered",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(root / "tiered" / "core" / "sizes.py", "a") as f:
        f.write("\n# another installation's change\n")
    return str(root)


def run_from(installation: str, folder: str, what: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", TRY, folder, what], cwd=installation,
                          env=clean_env(PYTHONPATH=installation), capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("what", ["hold", "attach"])
def test_another_installation_is_refused_by_name_with_the_remedy(service, other_installation,
                                                                 what):
    refused = run_from(other_installation, service, what)
    assert refused.returncode == 3, (refused.stdout, refused.stderr)
    said = refused.stdout
    ours = this_code()
    assert f"the service runs tiered {ours.version}, code {ours.code}, from " \
           f"{ours.installation}" in said, said
    assert f"this process runs tiered {ours.version}, code " in said, said
    assert f"from {os.path.join(other_installation, 'tiered')}" in said, said
    assert "tiered daemon stop" in said and "TIERED_RUNTIME_DIR" in said, said


@pytest.mark.parametrize("what", ["hold", "attach"])
def test_the_same_installation_is_served(service, what):
    served = run_from(str(REPO), service, what)
    assert served.returncode == 0, (served.stdout, served.stderr)


def test_daemon_status_names_the_installation_and_its_code(service, capsys, monkeypatch):
    monkeypatch.setenv(RUNTIME_ENV, service)
    assert tiered(["daemon", "status"]) == 0
    ours = this_code()
    assert f"runs the code of {ours.installation} (code {ours.code})" in capsys.readouterr().out
