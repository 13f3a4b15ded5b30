"""The chat REPL driven through a real pseudo-terminal, as a person uses it."""
import json
import random
import sys
import time

import pexpect
import pytest

from conftest import model_path


def spawn_chat(tmp_path, *args):
    env = {"MINILLM_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin", "TERM": "dumb"}
    child = pexpect.spawn(sys.executable, ["-m", "minillm", "chat", str(model_path("smollm2")), *args],
                          env=env, encoding="utf-8", timeout=120, dimensions=(40, 200))
    child.expect_exact(">>> ")
    return child


# llama.cpp's greedy reply to the first question, as built for this CPU (ggml's AVX2 and AVX-512
# builds round differently, and minillm computes as the build for its CPU: docs/fidelity.md)
GREEDY_REPLIES = {True: "L'Étoile, la Marseillaise, la femme au roi",   # AVX-512
                  False: "L'Étoile, la Marseillaise, la femme au martyre"}  # AVX2 (llama.cpp b11434 built here)


@pytest.mark.slow
def test_chat_two_turns_slash_commands_and_exit(tmp_path):
    from minillm.kernels.cpu.ops import GGML_AVX512

    GREEDY_REPLY = GREEDY_REPLIES[GGML_AVX512]
    child = spawn_chat(tmp_path, "--temp", "0", "-n", "40")
    child.sendline("What is the capital of France?")
    child.expect_exact(">>> ")
    first = child.before
    assert GREEDY_REPLY in first  # llama.cpp's greedy reply
    child.sendline("/show")
    child.expect(r"messages: 2; tokens in context: (\d+)")
    context_after_first = int(child.match.group(1))
    child.expect_exact(">>> ")
    child.sendline("Repeat the first word of your previous answer.")
    child.expect_exact(">>> ")
    child.sendline("/show")
    child.expect(r"messages: 4; tokens in context: (\d+)")
    assert int(child.match.group(1)) > context_after_first  # the second turn extends the first
    child.expect_exact(">>> ")
    saved = tmp_path / "conv.json"
    child.sendline(f"/save {saved}")
    child.expect_exact("saved 4 messages")
    child.expect_exact(">>> ")
    child.sendline("/set temperature 0.5")
    child.expect_exact("temperature = 0.5")
    child.expect_exact(">>> ")
    child.sendline('"""')
    child.sendline("Say hi")
    child.sendline('in two words"""')
    child.expect_exact(">>> ")
    child.sendline(f"/load {saved}")
    child.expect_exact("loaded 4 messages")
    child.expect_exact(">>> ")
    child.sendline("/clear")
    child.expect_exact("conversation cleared")
    child.expect_exact(">>> ")
    child.sendline("/show")
    child.expect(r"messages: 0; tokens in context: 0 of")
    child.expect_exact(">>> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    conv = json.loads(saved.read_text())
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant", "user", "assistant"]
    assert conv["messages"][0]["content"] == "What is the capital of France?"


@pytest.mark.slow
def test_ctrl_c_stops_a_reply_and_twice_leaves(tmp_path):
    child = spawn_chat(tmp_path, "-n", "2000", "--temp", "1.0", "--seed", "1")
    child.sendline("Write a very long story about a dragon.")
    child.expect_exact("dragon.")  # the echo of the input
    child.expect(r"\w+ \w+ \w+ \w+")  # the reply is streaming
    child.sendintr()
    child.expect_exact("[stopped]")
    child.expect_exact(">>> ")
    child.sendintr()  # the moment the prompt returns
    child.expect_exact("Ctrl+C again", timeout=10)
    child.sendintr()
    child.expect(pexpect.EOF, timeout=10)


@pytest.mark.slow
def test_ctrl_d_leaves(tmp_path):
    child = spawn_chat(tmp_path)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


# A chat without a model whose main thread, waiting for a key in readline, gets a SIGINT that is
# already taken (the race a real Ctrl+C loses when it lands just before readline's select()):
# _thread.interrupt_main() trips the signal as the C handler does but interrupts no system call.
_TAKEN_SIGINTS = """
import _thread, threading, time
from minillm.cli.repl import Chat, repl
from minillm.sampling import SamplingParams

def interrupt_at_the_prompt():
    for _ in range(ROUNDS):
        time.sleep(0.5)
        _thread.interrupt_main()

threading.Thread(target=interrupt_at_the_prompt, daemon=True).start()
repl(Chat(None, SamplingParams()))
"""


def test_a_ctrl_c_taken_before_readline_waits_is_answered_at_once(tmp_path):
    """Each SIGINT tripped while readline waits in select() is answered with the leave hint
    within a second, not at the next key; a line read between them keeps the chat open."""
    rounds = 5
    env = {"MINILLM_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin", "TERM": "dumb"}
    child = pexpect.spawn(sys.executable, ["-c", _TAKEN_SIGINTS.replace("ROUNDS", str(rounds))], env=env,
                          encoding="utf-8", timeout=5, dimensions=(40, 200))
    child.expect_exact(">>> ")
    for _ in range(rounds):
        child.expect_exact("(Ctrl+C again or Ctrl+D to leave)", timeout=3)
        child.expect_exact(">>> ")
        child.sendline("/help")
        child.expect_exact("/exit")
        child.expect_exact(">>> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)


@pytest.mark.slow
def test_every_ctrl_c_around_the_prompts_return_is_answered_at_once(tmp_path):
    """Ctrl+C pressed at random moments around a reply's end and the prompt's return: right as
    `>>> ` appears (where CPython's readline could wait in select() with the signal already
    taken), a little later, or while the short reply still streams. Each is answered within
    seconds by ` [stopped]` or the leave hint, and one press never leaves the chat."""
    rng = random.Random(5)
    child = spawn_chat(tmp_path, "-n", "3", "--temp", "0")
    for round_ in range(40):
        child.sendline("Hi")
        if round_ % 2:
            child.expect_exact(">>> ")  # the reply is over: press as the prompt returns, or just after
            time.sleep(rng.choice([0, 0, rng.uniform(0, 0.01)]))
        else:
            time.sleep(rng.uniform(0, 0.3))  # while the reply streams, or as it ends
        child.sendintr()
        answer = child.expect([r"\[stopped\]", r"\(Ctrl\+C again or Ctrl\+D to leave\)", pexpect.TIMEOUT], timeout=10)
        assert answer != 2, f"Ctrl+C in round {round_} went unanswered for 10 s"
        child.sendline("/help")  # a line read at the prompt: the next Ctrl+C is a first one again
        child.expect_exact("/exit")
        child.expect_exact(">>> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
