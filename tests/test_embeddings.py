"""POST /v1/embeddings through the official openai client, on the default model served for
real: each input's last hidden state as a unit vector, in OpenAI's shape, float or base64.
(tests/test_families.py holds the vectors themselves against transformers.)"""

import httpx
import numpy as np
import openai
import pytest

TEXTS = ["The capital of France is Paris.", "Paris is the capital of France.", "def add(a, b): return a + b"]


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def test_a_batch_of_texts_gives_unit_vectors_in_order(client, model):
    out = client.embeddings.create(model=model, input=TEXTS)  # the client asks for base64 and decodes it
    got = vectors(out)
    assert got.shape == (3, 576) and [d.index for d in out.data] == [0, 1, 2]
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert out.usage.prompt_tokens == out.usage.total_tokens > 3 * 5
    floats = vectors(client.embeddings.create(model=model, input=TEXTS, encoding_format="float"))
    np.testing.assert_array_equal(floats, got)
    # each alone: the same bits as in the batch (rows never depend on their batch)
    for i, text in enumerate(TEXTS):
        np.testing.assert_array_equal(vectors(client.embeddings.create(model=model, input=text))[0], got[i])
    assert not np.allclose(got[0], got[2], atol=1e-3)


def test_dimensions_cut_and_renormalise(client, model):
    full = vectors(client.embeddings.create(model=model, input=TEXTS[:1]))[0]
    cut = vectors(client.embeddings.create(model=model, input=TEXTS[:1], dimensions=64))[0]
    np.testing.assert_allclose(cut, full[:64] / np.linalg.norm(full[:64]), rtol=1e-5, atol=1e-6)


def test_token_ids_are_inputs_too(server, client, model):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": TEXTS[0]}, timeout=30).json()["tokens"]
    by_ids = vectors(client.embeddings.create(model=model, input=[ids]))[0]
    np.testing.assert_array_equal(by_ids, vectors(client.embeddings.create(model=model, input=TEXTS[0]))[0])


@pytest.mark.parametrize("kwargs,param", [({"input": TEXTS, "dimensions": 10_000}, "dimensions"),
                                          ({"input": []}, "input"), ({"input": [[10 ** 9]]}, "prompt")])
def test_bad_input_is_a_400_in_openais_shape(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=model, encoding_format="float", **kwargs)
    assert e.value.body["param"] == param
