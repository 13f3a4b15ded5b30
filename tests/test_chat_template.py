"""Chat templates: the model's own template renders like llama.cpp --jinja; hostile templates are
refused; models without a template get the documented plain format."""
import pytest

from conftest import MODELS
from minillm.chat_template import ChatTemplate, apply_chat_template, render_plain
from minillm.errors import MinillmError

HI = [{"role": "user", "content": "hi"}]
SMOLLM2_HI = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
              "Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def tokenizer(name: str):
    from minillm.gguf_file import GGUFFile
    from minillm.tokenizer import Tokenizer

    path = MODELS[name]
    if not path.exists():
        pytest.skip(f"{path.name} is absent (run `make models`)")
    return Tokenizer.from_gguf(GGUFFile(path))


@pytest.mark.slow
def test_smollm2_template_matches_llama_cpp():
    tok = tokenizer("smollm2")
    template = ChatTemplate.for_model(tok)
    assert template.render(HI) == SMOLLM2_HI
    # and the prompt tokenizes with <|im_start|> as one token
    ids = tok.tokenize(template.render(HI), special=True)
    assert ids[0] == 1 and ids.count(1) == 3


@pytest.mark.slow
def test_smollm2_template_variants():
    template = ChatTemplate.for_model(tokenizer("smollm2"))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello!"}]
    assert template.render(chat, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n")


@pytest.mark.slow
def test_model_without_template_gets_plain_format(capsys):
    template = ChatTemplate.for_model(tokenizer("gemma3"))
    assert template.is_plain
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert template.render(chat) == "System: Be brief.\nUser: hi\nAssistant:"
    assert "no chat template" in capsys.readouterr().err


@pytest.mark.slow
def test_override_file_and_leading_bos_stripped(tmp_path):
    tok = tokenizer("gemma3")  # adds BOS itself, so a template's own <bos> is dropped
    path = tmp_path / "t.jinja"
    path.write_text("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert ChatTemplate.for_model(tok, override_path=path).render(HI) == "<user>hi"
    with pytest.raises(MinillmError, match="missing.jinja"):
        ChatTemplate.for_model(tok, override_path=tmp_path / "missing.jinja")


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ self._TemplateReference__context }}",
    "{% set x = [] %}{{ x.append(1) }}",
    "{{ raise_exception.__globals__ }}",
])
def test_hostile_templates_are_refused(source):
    with pytest.raises(MinillmError, match="sandbox"):
        apply_chat_template(source, HI)


def test_template_errors_name_the_template():
    with pytest.raises(MinillmError, match="chat template file 'x.jinja'.*line 1"):
        ChatTemplate("{% for %}", name="chat template file 'x.jinja'")
    with pytest.raises(MinillmError, match="refused the messages: roles must alternate"):
        apply_chat_template("{{ raise_exception('roles must alternate') }}", HI)
    with pytest.raises(MinillmError, match="TypeError"):
        apply_chat_template("{{ messages[0].content + 1 }}", HI)
    with pytest.raises(MinillmError, match="role"):
        apply_chat_template("x", [{"content": "no role"}])


def test_hugging_face_helpers():
    source = ("{{ bos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
              "{{ m | tojson }}{% endfor %}{% if tools is none %}|no tools{% endif %}"
              "|{{ strftime_now('%Y') | length }}{{ eos_token }}")
    out = apply_chat_template(source, [{"role": "user", "content": "héllo"}, HI[0]],
                              bos_token="<s>", eos_token="</s>")
    assert out == '<s>{"role": "user", "content": "héllo"}|no tools|4</s>'


def test_generation_prompt_and_extra_variables():
    source = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
              "{% if add_generation_prompt %}[assistant]{% endif %}"
              "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}")
    assert apply_chat_template(source, HI) == "[user]hi[assistant]"
    assert apply_chat_template(source, HI, add_generation_prompt=False,
                               enable_thinking=False) == "[user]hi/no_think"


def test_trim_and_lstrip_blocks_like_hugging_face():
    source = "{% for m in messages %}\n    {{ m.content }}\n{% endfor %}"
    assert apply_chat_template(source, HI * 2) == "    hi\n    hi\n"


def test_plain_format_content_parts():
    chat = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None}]
    assert render_plain(chat, add_generation_prompt=False) == "User: ab\nAssistant: \n"
