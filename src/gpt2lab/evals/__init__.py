"""Evaluation of any GPT model: validation loss and HellaSwag."""
