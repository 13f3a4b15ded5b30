"""Every architecture against llama.cpp b11434, bit for bit: small models (tests/arch_cases.py)
regenerated from their seeds, compared with the logits and greedy tokens llama.cpp produced
on the same files (tests/data/arch_reference.npz, from tests/llama_ref/record_archs.py)."""
import hashlib

import numpy as np
import pytest

import minillm
from arch_cases import CASES, N_CTX, N_GREEDY, N_PROMPT, build, token_ids
from conftest import DATA
from minillm.generate import Session
from minillm.sampling import SamplingParams

REFERENCE = np.load(DATA / "arch_reference.npz")


def first_difference(ours: np.ndarray, ref: np.ndarray) -> str:
    row, col = np.argwhere(ours != ref)[0]
    step = "the prompt batch" if row == 0 else f"single token {row}"
    return (f"after {step}: logit {col} is {ours[row, col]!r}, llama.cpp's {ref[row, col]!r}; "
            f"{int((ours != ref).sum())} of {ref.size} differ, largest by {np.abs(ours - ref).max():.3g}")


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_tokens_match_llama_cpp(tmp_path, name):
    path = build(name).write(tmp_path / f"{name}.gguf")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == str(REFERENCE[f"{name}/sha256"]), "the regenerated file is not the one llama.cpp read"
    model = minillm.load(path)
    ids = token_ids(name)
    cache = model.new_cache(N_CTX)
    rows = [model.eval(ids[:N_PROMPT], cache, logits_from=N_PROMPT - 1)[0]]
    rows += [model.eval(ids[t:t + 1], cache)[0] for t in range(N_PROMPT, len(ids))]
    ours, ref = np.stack(rows), REFERENCE[f"{name}/logits"]
    assert np.array_equal(ours, ref), first_difference(ours, ref)

    chunks = Session(model, n_ctx=N_CTX).generate(list(ids[:N_PROMPT]), N_GREEDY, SamplingParams(temperature=0),
                                                  ignore_eos=True)
    greedy = [c.token for c in chunks if c.token is not None]
    assert greedy == REFERENCE[f"{name}/greedy"].tolist()
