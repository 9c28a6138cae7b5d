"""OpenAI's Batches API: a file of requests run line by line on the `WORK` queue by every worker holding the model
(`validation.py` reads the file, `records.py` keeps the state, `runner.py` runs it, `line.py` answers one line,
`output.py` writes the files)."""
