"""The terminal chat: a REPL over the model in this process (a Session that keeps its KV cache
across turns) or over a running server."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from .common import error_message
from ..errors import MinillmError
from ..generate import Session
from ..sampling import SamplingParams
from ..speculative import guess_summary

HELP = """Commands:
  /help               this text
  /clear              forget the conversation (keeps the system message)
  /system TEXT        set the system message (and clear the conversation)
  /set PARAM VALUE    change a setting: temperature, top_k, top_p, min_p, repeat_penalty,
                      repeat_last_n, presence_penalty, frequency_penalty, seed, n_predict, verbose
  /show               show the settings and the conversation length
  /save FILE          save the conversation as JSON
  /load FILE          load a conversation saved with /save
  /exit               leave (Ctrl+D too; Ctrl+C stops a reply, twice at the prompt leaves)
Enter \"\"\" to start and end a multi-line message."""

INT_SETTINGS = {"top_k", "repeat_last_n", "seed", "n_predict"}
FLOAT_SETTINGS = {"temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"}


class LocalReplies:
    """Replies from the model in this process; its Session keeps the KV cache across turns."""

    def __init__(self, model, n_ctx: int | None = None, template_path=None):
        self.model = model
        self.session = Session(model, n_ctx=n_ctx)
        self.template = model.chat_template(template_path)
        self.speculation = None  # a speculative.Speculation, to guess tokens (output unchanged)

    def stream(self, conversation: list[dict], n_predict: int, params: SamplingParams):
        prompt = self.template.render(conversation, add_generation_prompt=True)
        return self.session.generate(self.model.tokenize(prompt, special=True), n_predict, params,
                                     speculation=self.speculation)

    def reset(self) -> None:
        self.session.reset()

    def describe(self) -> str:
        return f"tokens in context: {len(self.session.tokens)} of {self.session.n_ctx}"


class RemoteReplies:
    """Replies from a running `minillm serve` (which keeps the conversation's cells itself)."""

    def __init__(self, client):
        self.client = client

    def stream(self, conversation: list[dict], n_predict: int, params: SamplingParams):
        return self.client.chunks(conversation, n_predict, params)

    def reset(self) -> None:
        pass

    def describe(self) -> str:
        return f"server: {self.client.base}"


class Chat:
    def __init__(self, replies, params: SamplingParams, n_predict: int = 512, system: str | None = None,
                 verbose: bool = False, out=sys.stdout):
        self.replies = replies  # LocalReplies or RemoteReplies
        self.params, self.n_predict, self.verbose = params, n_predict, verbose
        self.system = system
        self.messages: list[dict] = []
        self.out = out

    # -- conversation ------------------------------------------------------------------
    def conversation(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def reply(self, text: str) -> str:
        """Answer one user message, streaming it to out; Ctrl+C stops it early."""
        self.messages.append({"role": "user", "content": text})
        pieces, last = [], None
        try:
            for last in self.replies.stream(self.conversation(), self.n_predict, self.params):
                if last.text:
                    pieces.append(last.text)
                    self.out.write(last.text)
                    self.out.flush()
        except KeyboardInterrupt:
            self.out.write(" [stopped]")
        answer = "".join(pieces)
        self.messages.append({"role": "assistant", "content": answer})
        self.out.write("\n")
        self.out.flush()
        if self.verbose and last is not None:
            t = last.timings
            print(f"[{t.n_prompt} prompt tokens at {t.prompt_tokens_per_s:.1f} tok/s, {t.n_generated} "
                  f"generated at {t.generate_tokens_per_s:.1f} tok/s{guess_summary(t)}]", file=sys.stderr, flush=True)
        return answer

    # -- commands ------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a /command; False means leave."""
        name, _, arg = line[1:].strip().partition(" ")
        arg = arg.strip()
        handler = getattr(self, f"cmd_{name}", None)
        if handler is None:
            self.say(f"unknown command /{name}; /help lists them")
            return True
        return handler(arg) is not False

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def cmd_help(self, arg):
        self.say(HELP)

    def cmd_exit(self, arg):
        return False

    cmd_bye = cmd_quit = cmd_exit

    def cmd_clear(self, arg):
        self.messages = []
        self.replies.reset()
        self.say("conversation cleared")

    def cmd_system(self, arg):
        self.system = arg or None
        self.messages = []
        self.replies.reset()
        self.say("system message set" if arg else "system message removed")

    def cmd_set(self, arg):
        key, _, value = arg.partition(" ")
        key = {"temp": "temperature"}.get(key, key)
        try:
            if key == "verbose":
                self.verbose = value.strip().lower() in ("1", "on", "true", "yes")
            elif key == "n_predict":
                self.n_predict = int(value)
            elif key in INT_SETTINGS:
                setattr(self.params, key, int(value))
            elif key in FLOAT_SETTINGS:
                setattr(self.params, key, float(value))
            else:
                self.say(f"unknown setting '{key}'")
                return
        except ValueError:
            self.say(f"'{value}' is not a valid value for {key}")
            return
        self.say(f"{key} = {value.strip()}")

    def cmd_show(self, arg):
        settings = dict(self.params.as_dict(), n_predict=self.n_predict, verbose=self.verbose)
        self.say("\n".join(f"{k}: {v}" for k, v in settings.items()))
        self.say(f"system: {self.system!r}\nmessages: {len(self.messages)}; {self.replies.describe()}")

    def cmd_save(self, arg):
        if not arg:
            self.say("usage: /save FILE")
            return
        try:
            Path(arg).write_text(json.dumps({"system": self.system, "messages": self.messages},
                                            ensure_ascii=False, indent=2), encoding="utf-8")
        except OSError as exc:
            self.say(f"cannot save to {arg}: {exc.strerror or exc}")
            return
        self.say(f"saved {len(self.messages)} messages to {arg}")

    def cmd_load(self, arg):
        try:
            data = json.loads(Path(arg).read_text(encoding="utf-8"))
            messages = data["messages"]
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                       and isinstance(m.get("content"), str) for m in messages):
                raise ValueError("messages must be objects with string role and content")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.say(f"cannot load {arg}: {exc}")
            return
        self.system, self.messages = data.get("system"), messages
        self.replies.reset()
        self.say(f"loaded {len(messages)} messages from {arg}")


def read_message(prompt: str = ">>> ") -> str:
    """One user message; \"\"\" starts and ends a multi-line one. Raises EOFError, KeyboardInterrupt."""
    line = input(prompt)
    if not line.strip().startswith('"""'):
        return line
    lines = [line.strip()[3:]]
    if lines[0].endswith('"""'):
        return lines[0][:-3]
    while True:
        more = input("... ")
        if more.rstrip().endswith('"""'):
            lines.append(more.rstrip()[:-3])
            return "\n".join(lines).strip("\n")
        lines.append(more)


def setup_history() -> None:
    try:
        import readline
    except ImportError:  # not on every platform; input() still works
        return
    home = Path(os.environ.get("MINILLM_HOME", Path.home() / ".minillm"))
    history = home / "chat_history"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if history.exists():
            readline.read_history_file(history)
    except OSError:
        return
    import atexit

    def save():
        try:
            readline.write_history_file(history)
        except OSError:
            pass

    atexit.register(save)


class PromptInterrupts:
    """Ctrl+C at the prompt answered at once, every time. CPython's readline waits for a key in
    select() and runs the signal handlers only when select is interrupted: a SIGINT that lands
    after the prompt is drawn but before select begins leaves its handler pending, and select
    waits for the next key. Here every signal also writes a byte to a wakeup pipe
    (signal.set_wakeup_fd); a thread reading it pokes the main thread with SIGUSR1 (a handler
    that does nothing) while that prompt is still open, until select is interrupted and the
    pending SIGINT handler raises KeyboardInterrupt. A poke that lands after that only restarts
    select: one press is still one KeyboardInterrupt."""

    POKES_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)  # after a SIGINT, while its prompt is open

    def __init__(self):
        self.prompt = 0         # the prompts opened so far: the latest one's number
        self.reading = False    # the main thread is in prompt `prompt`

    def read(self, read_line):
        """read_line() at a prompt of its own number."""
        self.prompt += 1
        self.reading = True
        try:
            return read_line()
        finally:
            self.reading = False

    def __enter__(self):
        self._main = threading.get_ident()
        read_end, self._write_end = os.pipe()
        os.set_blocking(self._write_end, False)  # the C handler must never block on it
        self._old_fd = signal.set_wakeup_fd(self._write_end, warn_on_full_buffer=False)
        self._old_poke = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
        threading.Thread(target=self._watch, args=(read_end,), name="prompt-interrupts", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGUSR1, self._old_poke)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._write_end)  # the watcher reads end-of-file and leaves

    def _watch(self, read_end: int) -> None:
        with open(read_end, "rb", buffering=0) as wakeups:
            while data := wakeups.read(64):
                if signal.SIGINT in data:
                    self._poke(self.prompt)

    def _poke(self, prompt: int) -> None:
        for delay in self.POKES_S:
            time.sleep(delay)
            if not (self.reading and self.prompt == prompt):
                return
            signal.pthread_kill(self._main, signal.SIGUSR1)


def repl(chat: Chat) -> None:
    setup_history()
    chat.say('Chatting with the model. /help for commands, Ctrl+D or /exit to leave.')
    interrupted = False
    with PromptInterrupts() as prompt:
        while True:
            try:
                text = prompt.read(read_message)
                interrupted = False
                if not answer(chat, text):
                    return
            except EOFError:
                chat.say("")
                return
            except KeyboardInterrupt:  # at the prompt, or between a reply and the next prompt
                if interrupted:
                    chat.say("")
                    return
                interrupted = True
                chat.say("\n(Ctrl+C again or Ctrl+D to leave)")


def answer(chat: Chat, text: str) -> bool:
    """One line from the prompt: a /command, a message to reply to, or nothing; False: leave."""
    if not text.strip():
        return True
    if text.startswith("/"):
        return chat.command(text)
    try:
        chat.reply(text)
    except MinillmError as exc:
        chat.messages.pop()
        chat.say(f"error: {error_message(exc)}")
    return True
