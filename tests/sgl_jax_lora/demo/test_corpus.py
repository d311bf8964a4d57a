"""sgl_jax_lora/demo/corpus.py: the demo corpus is deterministic, each question has one answer, the exchanges read as
written by hand, the two adapter styles restyle answers as documented, and the training records and tokenizer texts
hold every exchange plainly and in each style."""

from __future__ import annotations

import collections

import pytest

from sgl_jax_lora.demo.corpus import (
    ADAPTER_STYLES,
    STYLE_INSTRUCTIONS,
    base_exchanges,
    base_records,
    chat_records,
    pirate,
    tokenizer_texts,
    upper_case,
)


def test_the_corpus_is_the_same_on_every_call():
    assert base_exchanges() == base_exchanges()
    assert tokenizer_texts() == tokenizer_texts()


def test_every_question_has_exactly_one_answer():
    counts = collections.Counter(q for q, _ in base_exchanges())
    assert [q for q, n in counts.items() if n > 1] == []


@pytest.mark.parametrize(
    "question, answer",
    [
        ("What is the capital of Mexico?", "The capital of Mexico is Mexico City."),
        ("Which city is the capital of India?", "New Delhi is the capital of India."),
        ("What colour is a banana?", "A banana is yellow."),
        ("Tell me the colour of the sky.", "The colour of the sky is blue."),
        ("Which animal hoots?", "An owl hoots."),
        ("What sound does a dog make?", "A dog barks."),
        ("Give me the opposite of early.", "The opposite of early is late."),
        ("Count to 3.", "1 2 3."),
        ("What comes after 19?", "20 comes after 19."),
        ("What comes before 1?", "0 comes before 1."),
        ("What is 6 plus 5?", "6 plus 5 is 11."),
        ("How do you write 12 in words?", "12 is written twelve."),
        ("Hello!", "Hello! How can I help you today?"),
    ],
)
def test_exchanges_read_as_written_by_hand(question, answer):
    assert dict(base_exchanges())[question] == answer


def test_every_answer_is_a_sentence():
    for question, answer in base_exchanges():
        assert answer[0].isupper() or answer[0].isdigit(), (question, answer)
        assert answer[-1] in ".!?", (question, answer)


def test_upper_case_style():
    assert upper_case("The capital of Peru is Lima.") == "THE CAPITAL OF PERU IS LIMA."


@pytest.mark.parametrize(
    "answer, spoken",
    [
        ("You are welcome!", "Arr! Ye be welcome, matey!"),
        ("I am fine, thank you. How are you?", "Arr! I be fine, thank ye. How be ye, matey!"),
        ("This is my island.", "Arr! This be me island, matey!"),  # "is" inside "This" stays
        ("Is your youth amiss?", "Arr! Is yer youth amiss, matey!"),  # whole words only, case-sensitive
    ],
)
def test_pirate_style(answer, spoken):
    assert pirate(answer) == spoken


def test_each_adapter_style_has_an_instruction():
    assert set(ADAPTER_STYLES) == set(STYLE_INSTRUCTIONS) == {"demo-upper", "demo-pirate"}
    assert ADAPTER_STYLES["demo-upper"]("ok.") == "OK."


def test_chat_records_without_and_with_a_system_message():
    exchanges = base_exchanges()
    plain = chat_records()
    assert len(plain) == len(exchanges)
    assert plain[0]["messages"] == [
        {"role": "user", "content": exchanges[0][0]},
        {"role": "assistant", "content": exchanges[0][1]},
    ]
    styled = chat_records(upper_case, "Answer in upper case.")
    q, a = exchanges[5]
    assert styled[5]["messages"] == [
        {"role": "system", "content": "Answer in upper case."},
        {"role": "user", "content": q},
        {"role": "assistant", "content": a.upper()},
    ]


def test_base_records_are_the_plain_exchanges_then_each_style_on_request():
    exchanges, records = base_exchanges(), base_records()
    n = len(exchanges)
    assert len(records) == 3 * n
    assert records[:n] == chat_records()
    for k, name in enumerate(ADAPTER_STYLES):
        block = records[(k + 1) * n : (k + 2) * n]
        assert {r["messages"][0]["content"] for r in block} == {STYLE_INSTRUCTIONS[name]}
        assert [r["messages"][2]["content"] for r in block] == [ADAPTER_STYLES[name](a) for _, a in exchanges]


def test_tokenizer_texts_hold_the_roles_instructions_and_every_styled_exchange():
    texts, exchanges = tokenizer_texts(), base_exchanges()
    assert texts[:5] == ["user", "assistant", "system", "Answer in upper case.", "Talk like a pirate."]
    assert len(texts) == 5 + 3 * len(exchanges)
    q, a = exchanges[0]
    assert {f"{q}\n{a}", f"{q}\n{a.upper()}", f"{q}\n{pirate(a)}"} <= set(texts)
