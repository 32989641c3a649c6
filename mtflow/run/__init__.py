"""TODO face"""
