"""tracing"""
