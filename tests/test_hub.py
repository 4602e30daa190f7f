"""hub.resolve_folder: local folders, bad paths and the offline Hugging Face cache. Never touches the network."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cudaformers.errors import CheckpointError
from cudaformers.hub import resolve_folder

ROOT = Path(__file__).resolve().parents[1]
REPO = "tiny-org/tiny-llama"
SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def build_cache(cache: Path, repo_id: str = REPO, sha: str = SHA) -> Path:
    """The layout huggingface_hub writes: models--owner--name/{refs/main, snapshots/<sha>/...}."""
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / sha
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(sha)
    return snapshot


def resolve_in_subprocess(name: str, **env_vars) -> subprocess.CompletedProcess:
    """resolve_folder in a fresh process: huggingface_hub reads HF_* variables at import, as it does for users."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(env_vars)
    code = "import sys; from cudaformers.hub import resolve_folder; print(resolve_folder(sys.argv[1]))"
    return subprocess.run([sys.executable, "-c", code, name], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_local_folder_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_folder(tmp_path) == tmp_path
    assert resolve_folder(str(tmp_path)) == tmp_path


def test_local_folder_wins_over_repo_id_lookup(tmp_path, monkeypatch):
    # A relative folder spelled like a repo id ("owner/name") is a local folder first.
    (tmp_path / "owner" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_folder("owner/name") == Path("owner/name")


def test_home_folder_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ckpt").mkdir()
    assert resolve_folder("~/ckpt") == tmp_path / "ckpt"


def test_file_instead_of_folder_names_the_folder(tmp_path):
    config = tmp_path / "config.json"
    config.write_text("{}")
    with pytest.raises(CheckpointError, match=r"is a file; pass the folder that holds it: from_pretrained\("):
        resolve_folder(config)
    gguf = tmp_path / "model.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match=r"gguf_file='model.Q4_K_M.gguf'"):
        resolve_folder(gguf)


@pytest.mark.parametrize("name", ["/no/such/folder", "./missing-model", "a/b/c", "not a repo"])
def test_missing_path_that_is_not_a_repo_id(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="neither a local folder nor a Hugging Face repo id"):
        resolve_folder(name)


def test_repo_id_missing_from_empty_cache_offline(tmp_path):
    with pytest.raises(CheckpointError, match=rf"'{REPO}' is not in the local Hugging Face cache.*HF_HUB_OFFLINE=1"):
        resolve_folder(REPO, cache_dir=str(tmp_path))


def test_local_files_only_without_offline_env(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(CheckpointError, match=rf"'{REPO}' is not in the local Hugging Face cache"):
        resolve_folder(REPO, cache_dir=str(tmp_path), local_files_only=True)
    snapshot = build_cache(tmp_path)
    assert resolve_folder(REPO, cache_dir=str(tmp_path), local_files_only=True) == snapshot


def test_repo_id_in_hand_built_cache_resolves_offline(tmp_path):
    snapshot = build_cache(tmp_path)
    folder = resolve_folder(REPO, cache_dir=str(tmp_path))
    assert folder == snapshot and (folder / "config.json").is_file()
    assert resolve_folder(REPO, cache_dir=str(tmp_path), revision=SHA) == snapshot


def test_env_pointed_cache_missing_repo_is_a_clear_error(tmp_path):
    done = resolve_in_subprocess(REPO, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "home"),
                                 HF_HUB_CACHE=str(tmp_path / "hub"))
    assert done.returncode != 0
    assert "CheckpointError" in done.stderr and f"'{REPO}' is not in the local Hugging Face cache" in done.stderr
    assert f"download {REPO}" in done.stderr  # the command that fills the cache


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_env_pointed_cache_resolves_offline(tmp_path, variable):
    cache = tmp_path / "hub"
    snapshot = build_cache(cache)
    where = {"HF_HUB_CACHE": str(cache)} if variable == "HF_HUB_CACHE" else {"HF_HOME": str(tmp_path)}
    done = resolve_in_subprocess(REPO, HF_HUB_OFFLINE="1", **where)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == snapshot
