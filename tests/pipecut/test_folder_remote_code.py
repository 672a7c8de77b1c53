"""No code from model folders: every transformers call passes trust_remote_code, and a folder
whose model needs its own code is refused unless --trust-remote-code says otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import write_llama
from pipecut.cli import main
from pipecut.folder import HFFolder, RemoteCodeError
from pipecut.train import resolve
from pipecut.train.config import TrainConfigError

ROOT = Path(__file__).resolve().parents[2]

_CONFIGURATION = r'''
with open({marker!r}, "a") as f:
    f.write("configuration_evil.py ran\n")
from transformers import LlamaConfig


class EvilConfig(LlamaConfig):
    model_type = "evil"
'''
_MODELING = r'''
with open({marker!r}, "a") as f:
    f.write("modeling_evil.py ran\n")
from transformers import LlamaForCausalLM

from .configuration_evil import EvilConfig


class EvilForCausalLM(LlamaForCausalLM):
    config_class = EvilConfig
'''


def write_evil(directory: Path, marker: Path) -> Path:
    """A folder whose config.json maps its model to code in the folder, which writes ``marker`` when imported."""
    write_llama(directory, weights=False, tokenizer=False)
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type="evil", architectures=["EvilForCausalLM"], auto_map={
        "AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "configuration_evil.py").write_text(_CONFIGURATION.format(marker=str(marker)))
    (directory / "modeling_evil.py").write_text(_MODELING.format(marker=str(marker)))
    return directory


def _pipecut(args: list[str], tmp_path: Path, stdin: str) -> subprocess.CompletedProcess[str]:
    """``python -m pipecut ARGS`` (the console script's entry point) with ``stdin`` as its input."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules")}  # where transformers copies a folder's code
    return subprocess.run([sys.executable, "-m", "pipecut", *args], input=stdin, capture_output=True, text=True,
                          timeout=240, cwd=tmp_path, env=env)


# A "y" on stdin is refused as no input is: one mechanism (nothing is asked), so no input is the long profile's.
@pytest.mark.parametrize("stdin", [pytest.param("", marks=pytest.mark.long), "y\n"], ids=["no-input", "yes-on-stdin"])
def test_a_folder_with_its_own_code_is_refused_and_none_of_it_runs(
    stdin: str, tmp_path: Path, token_file: Path
) -> None:
    marker = tmp_path / "code-ran"
    folder = write_evil(tmp_path / "evil", marker)
    done = _pipecut(["train", "--model", str(folder), "--data", str(token_file), "--out", str(tmp_path / "run"),
                     "--seq-len", "16", "--steps", "1"], tmp_path, stdin)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "the model needs code from the folder" in done.stderr and "--trust-remote-code" in done.stderr
    assert "auto_map in config.json: AutoConfig -> configuration_evil.EvilConfig" in done.stderr
    assert "configuration_evil.py, modeling_evil.py" in done.stderr
    assert "[y/N]" not in done.stdout + done.stderr  # nothing asked on stdin
    assert not marker.exists()
    assert not (tmp_path / "modules").exists()  # transformers never copied the code to import it


@pytest.mark.slow
def test_with_the_flag_the_folders_code_runs(tmp_path: Path) -> None:
    # The other side of the test above: the marker does appear when the code runs.
    marker = tmp_path / "code-ran"
    folder = write_evil(tmp_path / "evil", marker)
    plan = ["plan", str(folder), "--stages", "2", "--device", "cpu", "--seq-len", "16"]
    refused = _pipecut(plan, tmp_path, "y\n")
    assert refused.returncode == 2 and "--trust-remote-code" in refused.stderr and not marker.exists()
    done = _pipecut([*plan, "--trust-remote-code"], tmp_path, "")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pipecut plan: 2 stages" in done.stdout
    assert {"configuration_evil.py ran", "modeling_evil.py ran"} <= set(marker.read_text().splitlines())


def test_code_files_alone_and_a_tokenizers_auto_map_are_refused(tmp_path: Path) -> None:
    folder = write_llama(tmp_path / "m", weights=False, tokenizer=False)
    (folder / "modeling_llama.py").write_text("raise SystemExit('imported')\n")
    with pytest.raises(RemoteCodeError, match=r"files modeling_llama.py\).*--trust-remote-code"):
        HFFolder(folder)
    (folder / "modeling_llama.py").unlink()
    HFFolder(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["tok.T", None]}}))
    with pytest.raises(RemoteCodeError, match=r"auto_map in tokenizer_config.json: AutoTokenizer -> \['tok.T', None\]"):
        HFFolder(folder)
    assert HFFolder(folder, trust_remote_code=True).custom_code()


def test_every_transformers_call_passes_trust_remote_code(llama_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    calls: list[tuple[str, Any]] = []

    def spy(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls.append((f"{owner.__name__}.{name}", kwargs.get("trust_remote_code", "missing")))
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)

    spy(transformers.AutoConfig, "from_pretrained")
    spy(transformers.AutoTokenizer, "from_pretrained")
    spy(transformers.AutoModelForCausalLM, "from_config")
    for trusted in (False, True):
        calls.clear()
        folder = HFFolder(llama_folder, trust_remote_code=trusted)
        folder.build(meta=True, config=folder.config)
        folder.tokenizer()
        # (AutoTokenizer reads the config again through AutoConfig, passing the value on.)
        assert {name for name, _ in calls} == {"AutoConfig.from_pretrained", "AutoModelForCausalLM.from_config",
                                               "AutoTokenizer.from_pretrained"}
        assert all(value is trusted for _, value in calls), calls


def test_trust_remote_code_is_a_setting(tmp_path: Path) -> None:
    base = {"model": "m", "data": "d", "out": str(tmp_path)}
    assert resolve(base, {}).trust_remote_code is False
    assert resolve(base, {"trust_remote_code": True}).trust_remote_code is True
    with pytest.raises(TrainConfigError, match="trust_remote_code must be true or false, got 'yes'"):
        resolve({**base, "trust_remote_code": "yes"}, {})


def test_the_train_flag_reaches_the_folder(tmp_path: Path, token_file: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[bool] = []
    real = HFFolder.__init__

    def spy(self: HFFolder, path: Any, *, trust_remote_code: bool = False) -> None:
        opened.append(trust_remote_code)
        real(self, path, trust_remote_code=trust_remote_code)

    monkeypatch.setattr(HFFolder, "__init__", spy)
    folder = write_llama(tmp_path / "m", weights=False, tokenizer=False)
    args = ["train", "--model", str(folder), "--data", str(token_file), "--seq-len", "100"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 2  # stops at --seq-len, after the folder opened
    assert main([*args, "--out", str(tmp_path / "b"), "--trust-remote-code"]) == 2
    assert opened == [False, True]
    assert "longer than the model's 64 positions" in capsys.readouterr().err
