"""The parts of the tokenized providers (bert_mlm, classification, token_classification).

provider.py is the skeleton they fill in; wordpiece.py loads their tokenizer, ragged.py keeps
token sequences as flat arrays and encodes text into them, artifacts.py caches those arrays
under the dataset, hf_rows.py reads the columns of a Hugging Face dataset's rows, rows.py lays
out fixed-width [CLS] ... [SEP] rows, and labels.py holds the label maps and the held-out
split of labelled examples.
"""
