"""A tiny English corpus: the text the tiny test models' tokenizer is trained on and the documents
the quick checks and CPU benchmarks compress."""

CORPUS = (
    "The parties agree that the supplier shall deliver the goods. Any breach of this agreement "
    "shall be settled by the court of Shanghai. Confidential information shall not be disclosed. "
    "What is the capital of France? Paris is the capital of France. Once upon a time there was a "
    "contract between two companies about payment, penalty, jurisdiction and force majeure. "
) * 4
