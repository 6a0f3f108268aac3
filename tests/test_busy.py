"""One call at a time per SpeculativeGenerator: threads wait for each other, a second call while this thread's
own stream iterator is unfinished raises BusyError, and finishing, closing or dropping the iterator frees the
generator. Without the guard, interleaved calls share the KV caches and round state and both texts come out
wrong without an error (docs/hardening.md, item 1)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from fsd_eagle.api import SpeculativeGenerator
from fsd_eagle.errors import BusyError, FSDError
from test_api import TREE, make_llama, make_tokenizer, noisy_copy

torch.set_num_threads(1)

PROMPTS = ["w5 w6 w7", "w90 w91 w92 w93", "w40 w41", "w11 w12 w13 w14 w15"]
N = 20


@pytest.fixture(scope="module")
def gen():
    model = make_llama(seed=0)
    return SpeculativeGenerator(model, make_tokenizer(), draft_model=noisy_copy(model), tree=TREE)


@pytest.fixture(scope="module")
def refs(gen):
    """Each prompt's text from calls made one after another; the prompts' texts differ."""
    texts = {p: gen.generate(p, N).text for p in PROMPTS}
    assert len(set(texts.values())) == len(PROMPTS)
    return texts


def assert_busy(info) -> None:
    assert isinstance(info.value, FSDError)
    msg = str(info.value)
    assert "\n" not in msg and "already running a call" in msg and "another generator" in msg


def test_a_second_call_while_this_threads_stream_is_open_is_refused(gen, refs):
    first = gen.stream(PROMPTS[0], N)
    text = next(first)
    second = gen.stream(PROMPTS[1], N)
    with pytest.raises(BusyError) as info:
        next(second)
    assert_busy(info)
    with pytest.raises(BusyError):
        gen.generate(PROMPTS[2], N)
    text += "".join(first)  # the open call was not disturbed by the refused ones
    assert text == refs[PROMPTS[0]]
    assert "".join(gen.stream(PROMPTS[1], N)) == refs[PROMPTS[1]]  # exhausted: the generator is free again


@pytest.mark.parametrize("release", ["close", "drop"])
def test_closing_or_dropping_a_stream_frees_the_generator(gen, refs, release):
    stream = gen.stream(PROMPTS[0], N)
    next(stream)
    with pytest.raises(BusyError):
        gen.generate(PROMPTS[1], N)
    if release == "close":
        stream.close()
    else:
        del stream
        gc.collect()
    assert gen.generate(PROMPTS[1], N).text == refs[PROMPTS[1]]


def test_an_unstarted_stream_holds_nothing(gen, refs):
    stream = gen.stream(PROMPTS[0], N)  # nothing runs before the first next()
    assert gen.generate(PROMPTS[1], N).text == refs[PROMPTS[1]]
    assert "".join(stream) == refs[PROMPTS[0]]


def test_threads_wait_for_each_other_and_get_their_own_texts(gen, refs):
    results, errors = [], []

    def work(prompt: str) -> None:
        for _ in range(3):
            try:
                results.append((prompt, gen.generate(prompt, N).text))
            except Exception as e:  # noqa: BLE001 - any error is a failure of the test
                errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert len(results) == 3 * len(PROMPTS)
    assert all(text == refs[prompt] for prompt, text in results)


def test_a_call_waits_for_another_threads_open_stream(gen, refs):
    started, go_on = threading.Event(), threading.Event()
    streamed = []

    def streamer() -> None:
        stream = gen.stream(PROMPTS[0], N)
        streamed.append(next(stream))
        started.set()
        go_on.wait(timeout=60)
        streamed.extend(stream)

    holder = threading.Thread(target=streamer)
    holder.start()
    assert started.wait(timeout=60)
    waited = []
    caller = threading.Thread(target=lambda: waited.append(gen.generate(PROMPTS[1], N).text))
    caller.start()
    caller.join(timeout=0.5)
    assert caller.is_alive() and not waited  # blocked by the other thread's open stream, not refused
    go_on.set()
    holder.join(timeout=60)
    caller.join(timeout=60)
    assert "".join(streamed) == refs[PROMPTS[0]] and waited == [refs[PROMPTS[1]]]
