"""One rule for turning task prompts and answers into ids (factory/models/prompting.py): the model's chat template
when it has one, the bare prompt for the presets' character tokenizers."""

from __future__ import annotations

from transformers import AutoTokenizer

from factory.core.rollout.server.chat import ChatTemplate
from factory.models.bpe import IM_END
from factory.models.prompting import answer_ids, prompt_ids, uses_chat_template
from factory.models.tokenizer import build_tokenizer


def test_character_tokenizer_encodes_the_bare_prompt():
    tok = build_tokenizer()
    assert not uses_chat_template(tok)
    assert prompt_ids(tok, "12+34=") == tok("12+34=").input_ids
    assert answer_ids(tok, "46") == tok("46", add_special_tokens=False).input_ids + [tok.eos_token_id]


def test_chat_model_prompt_is_one_user_turn_with_the_generation_prompt(bpe_model_dir):
    tok = AutoTokenizer.from_pretrained(bpe_model_dir)
    ids = prompt_ids(tok, "12+34=")
    assert tok.decode(ids) == "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
    # the rollout server's chat endpoint renders a one-message conversation to the same ids
    assert ChatTemplate(tok).render([{"role": "user", "content": "12+34="}], generation_prompt=True) == ids


def test_chat_model_answer_closes_the_turn(bpe_model_dir):
    tok = AutoTokenizer.from_pretrained(bpe_model_dir)
    ids = answer_ids(tok, "46")
    assert ids[-1] == tok.convert_tokens_to_ids(IM_END) == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "46"
    # prompt + answer is the ChatML conversation the template writes for the same two messages
    full = tok.apply_chat_template([{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "46"}],
                                   tokenize=False)
    assert tok.decode(prompt_ids(tok, "12+34=") + ids) + "\n" == full


def test_the_rollout_server_serves_a_path_model_with_its_template(bpe_model_dir):
    """`factory serve --checkpoint DIR` on a model.path directory: the chat endpoint renders the model's ChatML, the
    same ids training used for the same prompt."""
    import openai

    from factory.core.rollout.server.app import engine_from_checkpoint, launch_server

    engine = engine_from_checkpoint(bpe_model_dir, max_batch=4)
    tok = engine.tokenizer
    assert uses_chat_template(tok)
    with launch_server(engine) as handle:
        c = openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0, timeout=30)
        r = c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "12+34="}], max_tokens=4,
                                      seed=1)
        (choice,) = r.choices
        assert choice.prompt_token_ids == prompt_ids(tok, "12+34=")
        assert tok.decode(choice.token_ids, skip_special_tokens=True) == (choice.message.content or "")
