"""Corpora, tokenizers and the grain pipeline that packs documents into batches."""
