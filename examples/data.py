"""Packed byte-level training data for `train.py`, read at run time: no download, no tokenizer.

Tokens are bytes (vocabulary 256). The documents are the sections of the repository's own `docs/*.md` (each file
split before every heading), or of any text files you name; with none found, a small generated text. Documents are
laid end to end and cut into rows of `seq_len` tokens, with segment ids `1, 2, ...` for the documents (or document
parts) of a row and 0 for the padding of the last row. The model attends only within a document and restarts its
rotary positions at each one (`llama.segment_positions`); the loss never predicts across a document boundary.

    documents = data.load_documents()                       # list[bytes]
    tokens, segment_ids = data.pack(documents, seq_len=256)  # int32 [rows, 256] each
    for tokens_b, segment_ids_b in data.batches(tokens, segment_ids, batch_size=8, seed=0): ...
"""

import pathlib
import re
from collections.abc import Iterator, Sequence

import numpy as np


VOCAB_SIZE = 256
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def split_markdown(text: str) -> list[str]:
    """Sections of a Markdown text: a new one starts at every heading line (`#`, `##`, ...)."""
    parts = re.split(r"\n(?=#{1,6} )", text)
    return [part.strip() + "\n" for part in parts if part.strip()]


def generated_documents(num_documents: int = 400, seed: int = 0) -> list[str]:
    """A small generated text: short paragraphs of simple sentences (enough structure to learn in a few steps)."""
    rng = np.random.default_rng(seed)
    subjects = ["the cat", "a dog", "the model", "my friend", "the teacher", "a bird", "the river", "our team"]
    verbs = ["sees", "likes", "follows", "finds", "reads", "builds", "crosses", "counts"]
    objects = ["the ball", "a book", "the road", "many stars", "the garden", "a small boat", "the numbers"]
    endings = [".", ".", ".", "!", " today.", " again."]
    documents = []
    for _ in range(num_documents):
        sentences = []
        for _ in range(rng.integers(2, 12)):
            words = [rng.choice(subjects), rng.choice(verbs), rng.choice(objects)]
            sentence = " ".join(words) + rng.choice(endings)
            sentences.append(sentence[0].upper() + sentence[1:])
        documents.append(" ".join(sentences) + "\n")
    return documents


def load_documents(paths: Sequence[str | pathlib.Path] | None = None) -> list[bytes]:
    """UTF-8 bytes of the documents: the sections of the Markdown files among `paths` (files or directories of
    `*.md` / `*.txt`), each other text file whole. Defaults to the repository's `docs/` folder; with no file found,
    `generated_documents()`."""
    files: list[pathlib.Path] = []
    for path in [DOCS] if paths is None else paths:
        path = pathlib.Path(path)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in (".md", ".txt") and p.is_file())
        elif path.is_file():
            files.append(path)
    texts: list[str] = []
    for file in files:
        text = file.read_text(encoding="utf-8", errors="replace")
        texts += split_markdown(text) if file.suffix == ".md" else [text]
    if not texts:
        texts = generated_documents()
    return [text.encode("utf-8") for text in texts]


def pack(documents: Sequence[bytes], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack documents into rows of `seq_len` tokens, in order, filling every row.

    Documents are laid end to end; where a row is full, the document being laid continues at the start of the next
    row as a new segment (it cannot see its earlier part, and its positions restart at 0). Only the last row has
    padding (token 0, segment 0).

    Returns:
        `(tokens, segment_ids)`, int32 `[rows, seq_len]` each; segment ids count `1, 2, ...` within each row.
    """
    if seq_len < 2:
        raise ValueError(f"`seq_len` must be at least 2. Got {seq_len}.")
    stream = np.frombuffer(b"".join(documents), np.uint8).astype(np.int32)
    # Document number of every token, counting from 1; a new row restarts the count (at its first token's document).
    doc = np.repeat(np.arange(1, len(documents) + 1, dtype=np.int32), [len(d) for d in documents])
    rows = -(-len(stream) // seq_len)
    tokens = np.zeros(rows * seq_len, np.int32)
    segment_ids = np.zeros(rows * seq_len, np.int32)
    tokens[: len(stream)] = stream
    segment_ids[: len(stream)] = doc
    tokens, segment_ids = tokens.reshape(rows, seq_len), segment_ids.reshape(rows, seq_len)
    segment_ids = np.where(segment_ids > 0, segment_ids - segment_ids[:, :1] + 1, 0)
    return tokens, segment_ids


def batches(
    tokens: np.ndarray, segment_ids: np.ndarray, batch_size: int, seed: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless batches of `batch_size` rows: the rows in a random order, reshuffled every epoch (an epoch's last rows
    that do not fill a batch start the next one)."""
    rng = np.random.default_rng(seed)
    order = np.zeros(0, np.int64)
    while True:
        while len(order) < batch_size:
            order = np.concatenate([order, rng.permutation(len(tokens))])
        take, order = order[:batch_size], order[batch_size:]
        yield tokens[take], segment_ids[take]
