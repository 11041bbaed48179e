"""What the chat tests share: a byte-level BPE tokenizer with chat special tokens, three chat
templates (Llama 3 headers; ChatML with a default system prompt; one that skips tool messages,
marks `{% generation %}` and has a generation prompt) and conversations to render."""

import json

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|im_start|>", "<|im_end|>"]

LLAMA3 = (
    "{% for message in messages %}"
    "{% set turn = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' %}"
    "{% if loop.first %}{% set turn = bos_token + turn %}{% endif %}"
    "{{ turn }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

CHATML = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SKIPPING = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{% continue %}{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '### Assistant:\\n' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '### ' + message['role'] | capitalize + ':\\n' + message['content'] + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Assistant:\\n' }}{% endif %}"
)

TEMPLATES = {"llama3": LLAMA3, "chatml": CHATML, "skipping": SKIPPING}

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "2 + 2 = 4."}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."},
     {"role": "user", "content": "Another, in Greek: έπτά?"}, {"role": "assistant", "content": "  Eleven (ένδεκα).  "}],
    [{"role": "user", "content": "Look it up."}, {"role": "tool", "content": "{\"result\": 42}"},
     {"role": "assistant", "content": "It is 42."}],
]

_CORPUS = [
    "What is two plus two? The answer is four. Name a prime number: seven, eleven, thirteen.",
    "You are a helpful assistant. Answer briefly. Look it up, the result is forty two.",
    "System user assistant tool: roles of a conversation. Greek: έπτά, ένδεκα.",
]


def write_chat_tokenizer(directory, template: str | None, *, bos="<|begin_of_text|>", eos="<|eot_id|>"):
    """A byte-level BPE tokenizer.json trained on a few sentences, and a tokenizer_config.json that
    names its special tokens and (when given) the chat template; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
                "pad_token": "<|end_of_text|>"}
    if template is not None:
        settings["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory
