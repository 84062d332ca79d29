"""Speculative decoding's math: proposals (n-gram lookup) and their exact verification."""
