"""The project around the code: the reference build's flags and the user docs."""
import platform
import re
import shutil
import subprocess

import pytest

from conftest import ROOT


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("gcc") is None, reason="x86-64 gcc flags")
def test_the_reference_build_leaves_amx_out_on_cpus_that_have_it():
    """tests/llama_ref/build.sh builds natively; on an AMX CPU ggml's AMX code crashes, so its
    flags must take AMX out even where -march turns it on (Sapphire Rapids' set stands in for
    such a host's -march=native), and leave AVX-512 VNNI in."""
    flags = subprocess.run(["bash", str(ROOT / "tests/llama_ref/build.sh"), "--cflags"], capture_output=True,
                           text=True, check=True).stdout.split()
    for order in (["-march=sapphirerapids", *flags], [*flags, "-march=sapphirerapids"]):
        macros = subprocess.run(["gcc", *order, "-dM", "-E", "-"], input="", capture_output=True, text=True,
                                check=True).stdout
        assert "__AVX512VNNI__" in macros
        assert not re.findall(r"__AMX_\w+__", macros), order


CHRONOLOGY = re.compile(r"\b(this|last|earlier|previous) (session|round)\b|\b(session|round) \d+\b"
                        r"|\bthe (final|last) code\b|\bthe last code change\b", re.I)


def test_user_docs_date_figures_rather_than_tell_the_story():
    """README and docs/ state facts with their date and machine; how they were reached belongs
    in commit messages."""
    found = [f"{path.name}:{n}: {line.strip()}" for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             for n, line in enumerate(path.read_text().splitlines(), 1) if CHRONOLOGY.search(line)]
    assert not found, "\n".join(found)
