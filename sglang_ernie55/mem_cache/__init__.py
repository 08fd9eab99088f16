"""mem_cache"""
