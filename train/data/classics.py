"""Small classic Python functions written for the synthetic data (this project's own code).

Each entry: the function name(s), a one-line task description, implementations (complete
sources; the first line is the signature), example calls whose results are computed by
running the implementation, and bug variants (a textual replacement inside one
implementation) for the test-fixing conversations.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List

CLASSICS: List[Dict[str, Any]] = [
    {
        "names": ["fib", "fibonacci", "fib_number"],
        "task": "return the n-th Fibonacci number",
        "impls": [
            'def fib(n):\n    """Return the n-th Fibonacci number (fib(0) == 0, fib(1) == 1)."""\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n',
            'def fib(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n',
            'def fib(n):\n    """Return the n-th Fibonacci number, computed iteratively."""\n    if n < 0:\n        raise ValueError("n must be non-negative")\n    prev, curr = 0, 1\n    for _ in range(n):\n        prev, curr = curr, prev + curr\n    return prev\n',
        ],
        "calls": ["fib(0)", "fib(1)", "fib(2)", "fib(7)", "fib(10)"],
        "bugs": [("a, b = b, a + b", "a, b = b, a + a"), ("range(n)", "range(n - 1)")],
    },
    {
        "names": ["factorial", "fact"],
        "task": "return n! for a non-negative integer n",
        "impls": [
            'def factorial(n):\n    """Return n! for a non-negative integer n."""\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n',
            'def factorial(n):\n    """Return the factorial of n."""\n    if n <= 1:\n        return 1\n    return n * factorial(n - 1)\n',
        ],
        "calls": ["factorial(0)", "factorial(1)", "factorial(5)", "factorial(6)"],
        "bugs": [("range(2, n + 1)", "range(2, n)")],
    },
    {
        "names": ["is_prime", "isprime", "check_prime"],
        "task": "tell whether an integer is a prime number",
        "impls": [
            'def is_prime(n):\n    """Return True if n is a prime number."""\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0:\n            return False\n        i += 1\n    return True\n',
            'def is_prime(n):\n    """Return True when n is prime, False otherwise."""\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5) + 1):\n        if n % d == 0:\n            return False\n    return True\n',
        ],
        "calls": ["is_prime(1)", "is_prime(2)", "is_prime(9)", "is_prime(13)", "is_prime(25)"],
        "bugs": [("while i * i <= n:", "while i * i < n:")],
    },
    {
        "names": ["gcd", "greatest_common_divisor"],
        "task": "return the greatest common divisor of two integers",
        "impls": [
            'def gcd(a, b):\n    """Return the greatest common divisor of a and b."""\n    while b:\n        a, b = b, a % b\n    return abs(a)\n',
        ],
        "calls": ["gcd(12, 18)", "gcd(7, 5)", "gcd(0, 9)", "gcd(48, 36)"],
        "bugs": [("return abs(a)", "return abs(b)")],
    },
    {
        "names": ["lcm", "least_common_multiple"],
        "task": "return the least common multiple of two positive integers",
        "impls": [
            'def lcm(a, b):\n    """Return the least common multiple of a and b."""\n    x, y = a, b\n    while y:\n        x, y = y, x % y\n    return a * b // x\n',
        ],
        "calls": ["lcm(4, 6)", "lcm(3, 5)", "lcm(12, 18)"],
        "bugs": [("return a * b // x", "return a * b // y if y else a + b")],
    },
    {
        "names": ["reverse_string", "reverse", "reversed_text"],
        "task": "return a string reversed",
        "impls": [
            'def reverse_string(s):\n    """Return s reversed."""\n    return s[::-1]\n',
            'def reverse_string(s):\n    """Return the characters of s in reverse order."""\n    out = []\n    for ch in s:\n        out.insert(0, ch)\n    return "".join(out)\n',
        ],
        "calls": ["reverse_string('abc')", "reverse_string('')", "reverse_string('hello')"],
        "bugs": [("s[::-1]", "s[:-1]")],
    },
    {
        "names": ["is_palindrome", "palindrome"],
        "task": "tell whether a string reads the same backwards, ignoring case and spaces",
        "impls": [
            'def is_palindrome(s):\n    """Return True if s is a palindrome, ignoring case and spaces."""\n    cleaned = s.replace(" ", "").lower()\n    return cleaned == cleaned[::-1]\n',
            'def is_palindrome(s):\n    """Return True when s reads the same in both directions (case and spaces ignored)."""\n    chars = [c.lower() for c in s if c != " "]\n    i, j = 0, len(chars) - 1\n    while i < j:\n        if chars[i] != chars[j]:\n            return False\n        i += 1\n        j -= 1\n    return True\n',
        ],
        "calls": ["is_palindrome('Racecar')", "is_palindrome('nurses run')", "is_palindrome('python')"],
        "bugs": [('.lower()', '')],
    },
    {
        "names": ["count_vowels", "vowel_count"],
        "task": "count the vowels in a string",
        "impls": [
            'def count_vowels(text):\n    """Return the number of vowels (a, e, i, o, u) in text."""\n    return sum(1 for ch in text.lower() if ch in "aeiou")\n',
        ],
        "calls": ["count_vowels('hello world')", "count_vowels('Python')", "count_vowels('AEIOU')"],
        "bugs": [("text.lower()", "text")],
    },
    {
        "names": ["binary_search", "bsearch", "find_index"],
        "task": "return the index of target in a sorted list, or -1",
        "impls": [
            'def binary_search(items, target):\n    """Return the index of target in the sorted list items, or -1."""\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n        mid = (lo + hi) // 2\n        if items[mid] == target:\n            return mid\n        if items[mid] < target:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n    return -1\n',
        ],
        "calls": ["binary_search([1, 3, 5, 7, 9], 7)", "binary_search([1, 3, 5, 7, 9], 9)", "binary_search([2, 4, 6], 5)"],
        "bugs": [("while lo <= hi:", "while lo < hi:")],
    },
    {
        "names": ["bubble_sort", "sort_list"],
        "task": "sort a list of numbers with bubble sort and return it",
        "impls": [
            'def bubble_sort(items):\n    """Sort items in place with bubble sort and return the list."""\n    n = len(items)\n    for i in range(n):\n        for j in range(n - 1 - i):\n            if items[j] > items[j + 1]:\n                items[j], items[j + 1] = items[j + 1], items[j]\n    return items\n',
        ],
        "calls": ["bubble_sort([3, 1, 2])", "bubble_sort([5, 4, 3, 2, 1])", "bubble_sort([])"],
        "bugs": [("range(n - 1 - i)", "range(n - 2 - i)")],
    },
    {
        "names": ["flatten", "flatten_list"],
        "task": "flatten a nested list into a flat list",
        "impls": [
            'def flatten(nested):\n    """Return a flat list with the items of the nested lists in nested."""\n    out = []\n    for item in nested:\n        if isinstance(item, list):\n            out.extend(flatten(item))\n        else:\n            out.append(item)\n    return out\n',
        ],
        "calls": ["flatten([1, [2, [3, 4]], 5])", "flatten([])", "flatten([[1], [2, 3]])"],
        "bugs": [("out.extend(flatten(item))", "out.append(item)")],
    },
    {
        "names": ["chunk", "chunks", "split_into_chunks"],
        "task": "split a list into chunks of a given size",
        "impls": [
            'def chunk(items, size):\n    """Split items into lists of at most size elements."""\n    return [items[i:i + size] for i in range(0, len(items), size)]\n',
        ],
        "calls": ["chunk([1, 2, 3, 4, 5], 2)", "chunk([1, 2, 3], 3)", "chunk([], 4)"],
        "bugs": [("items[i:i + size]", "items[i:i + size - 1]")],
    },
    {
        "names": ["unique", "dedupe", "remove_duplicates"],
        "task": "remove duplicates from a list while keeping the first occurrence order",
        "impls": [
            'def unique(items):\n    """Return the items without duplicates, in first-seen order."""\n    seen = set()\n    out = []\n    for x in items:\n        if x not in seen:\n            seen.add(x)\n            out.append(x)\n    return out\n',
        ],
        "calls": ["unique([1, 2, 1, 3, 2])", "unique(['a', 'b', 'a'])", "unique([])"],
        "bugs": [("            seen.add(x)\n", "")],
    },
    {
        "names": ["word_count", "count_words", "word_frequencies"],
        "task": "count how often each word occurs in a text",
        "impls": [
            'def word_count(text):\n    """Return a dict mapping each lower-cased word of text to its count."""\n    counts = {}\n    for word in text.lower().split():\n        counts[word] = counts.get(word, 0) + 1\n    return counts\n',
        ],
        "calls": ["word_count('the cat and the hat')", "word_count('Hi hi')", "word_count('')"],
        "bugs": [("counts.get(word, 0) + 1", "1")],
    },
    {
        "names": ["fizzbuzz", "fizz_buzz"],
        "task": "return the FizzBuzz sequence from 1 to n as strings",
        "impls": [
            'def fizzbuzz(n):\n    """Return the FizzBuzz strings for 1..n."""\n    out = []\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n            out.append("FizzBuzz")\n        elif i % 3 == 0:\n            out.append("Fizz")\n        elif i % 5 == 0:\n            out.append("Buzz")\n        else:\n            out.append(str(i))\n    return out\n',
        ],
        "calls": ["fizzbuzz(5)", "fizzbuzz(15)[-1]", "fizzbuzz(3)"],
        "bugs": [("range(1, n + 1)", "range(1, n)")],
    },
    {
        "names": ["sum_digits", "digit_sum"],
        "task": "return the sum of the decimal digits of an integer",
        "impls": [
            'def sum_digits(n):\n    """Return the sum of the decimal digits of n."""\n    n = abs(n)\n    total = 0\n    while n:\n        total += n % 10\n        n //= 10\n    return total\n',
        ],
        "calls": ["sum_digits(123)", "sum_digits(9045)", "sum_digits(0)"],
        "bugs": [("total += n % 10", "total += n % 100")],
    },
    {
        "names": ["max_subarray", "max_subarray_sum"],
        "task": "return the largest sum of a contiguous sub-list (Kadane's algorithm)",
        "impls": [
            'def max_subarray(nums):\n    """Return the largest sum of a non-empty contiguous sub-list of nums."""\n    best = current = nums[0]\n    for x in nums[1:]:\n        current = max(x, current + x)\n        best = max(best, current)\n    return best\n',
        ],
        "calls": ["max_subarray([-2, 1, -3, 4, -1, 2, 1, -5, 4])", "max_subarray([1, 2, 3])", "max_subarray([-3, -1, -2])"],
        "bugs": [("current = max(x, current + x)", "current = current + x")],
    },
    {
        "names": ["merge_sorted", "merge_lists"],
        "task": "merge two sorted lists into one sorted list",
        "impls": [
            'def merge_sorted(a, b):\n    """Merge the sorted lists a and b into a new sorted list."""\n    i = j = 0\n    out = []\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n',
        ],
        "calls": ["merge_sorted([1, 4, 6], [2, 3, 7])", "merge_sorted([], [1])", "merge_sorted([1, 2], [])"],
        "bugs": [("    out.extend(b[j:])\n", "")],
    },
    {
        "names": ["transpose", "transpose_matrix"],
        "task": "transpose a matrix given as a list of rows",
        "impls": [
            'def transpose(matrix):\n    """Return the transpose of matrix (a list of equal-length rows)."""\n    return [list(row) for row in zip(*matrix)]\n',
        ],
        "calls": ["transpose([[1, 2, 3], [4, 5, 6]])", "transpose([[1]])"],
        "bugs": [("zip(*matrix)", "zip(matrix)")],
    },
    {
        "names": ["celsius_to_fahrenheit", "c_to_f", "to_fahrenheit"],
        "task": "convert a temperature from Celsius to Fahrenheit",
        "impls": [
            'def celsius_to_fahrenheit(c):\n    """Convert degrees Celsius to degrees Fahrenheit."""\n    return c * 9 / 5 + 32\n',
        ],
        "calls": ["celsius_to_fahrenheit(0)", "celsius_to_fahrenheit(100)", "celsius_to_fahrenheit(-40)"],
        "bugs": [("c * 9 / 5 + 32", "c * 5 / 9 + 32")],
    },
    {
        "names": ["clamp", "clip"],
        "task": "limit a value to the range [lo, hi]",
        "impls": [
            'def clamp(x, lo, hi):\n    """Return x limited to the closed range [lo, hi]."""\n    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n    return x\n',
            'def clamp(x, lo, hi):\n    """Limit x to the range lo..hi."""\n    return max(lo, min(x, hi))\n',
        ],
        "calls": ["clamp(5, 0, 10)", "clamp(-3, 0, 10)", "clamp(42, 0, 10)"],
        "bugs": [("        return hi", "        return lo")],
    },
    {
        "names": ["mean", "average"],
        "task": "return the arithmetic mean of a list of numbers",
        "impls": [
            'def mean(values):\n    """Return the arithmetic mean of values (a non-empty list)."""\n    return sum(values) / len(values)\n',
        ],
        "calls": ["mean([1, 2, 3, 4])", "mean([10])", "mean([2.5, 3.5])"],
        "bugs": [("sum(values) / len(values)", "sum(values) / (len(values) + 1)")],
    },
    {
        "names": ["median", "median_value"],
        "task": "return the median of a list of numbers",
        "impls": [
            'def median(values):\n    """Return the median of a non-empty list of numbers."""\n    s = sorted(values)\n    mid = len(s) // 2\n    if len(s) % 2:\n        return s[mid]\n    return (s[mid - 1] + s[mid]) / 2\n',
        ],
        "calls": ["median([3, 1, 2])", "median([4, 1, 3, 2])", "median([7])"],
        "bugs": [("(s[mid - 1] + s[mid]) / 2", "s[mid]")],
    },
    {
        "names": ["capitalize_words", "title_case"],
        "task": "capitalize the first letter of every word",
        "impls": [
            'def capitalize_words(text):\n    """Return text with the first letter of every word in upper case."""\n    return " ".join(w[:1].upper() + w[1:] for w in text.split(" "))\n',
        ],
        "calls": ["capitalize_words('hello big world')", "capitalize_words('a')"],
        "bugs": [("w[:1].upper() + w[1:]", "w[:1].upper() + w[2:]")],
    },
    {
        "names": ["is_anagram", "anagrams"],
        "task": "tell whether two words are anagrams of each other",
        "impls": [
            'def is_anagram(a, b):\n    """Return True if a and b contain the same letters (case ignored)."""\n    return sorted(a.lower()) == sorted(b.lower())\n',
        ],
        "calls": ["is_anagram('listen', 'silent')", "is_anagram('night', 'Thing')", "is_anagram('abc', 'abd')"],
        "bugs": [("sorted(b.lower())", "sorted(b)")],
    },
    {
        "names": ["rotate", "rotate_list"],
        "task": "rotate a list to the right by k positions",
        "impls": [
            'def rotate(items, k):\n    """Return items rotated right by k positions."""\n    if not items:\n        return []\n    k %= len(items)\n    return items[-k:] + items[:-k]\n',
        ],
        "calls": ["rotate([1, 2, 3, 4, 5], 2)", "rotate([1, 2, 3], 4)", "rotate([], 1)"],
        "bugs": [("    k %= len(items)\n", "")],
    },
    {
        "names": ["running_sum", "cumulative_sum", "prefix_sums"],
        "task": "return the running totals of a list of numbers",
        "impls": [
            'def running_sum(nums):\n    """Return the list of running totals of nums."""\n    total = 0\n    out = []\n    for x in nums:\n        total += x\n        out.append(total)\n    return out\n',
        ],
        "calls": ["running_sum([1, 2, 3, 4])", "running_sum([5])", "running_sum([])"],
        "bugs": [("total += x", "total = x")],
    },
    {
        "names": ["second_largest", "runner_up"],
        "task": "return the second largest distinct number of a list",
        "impls": [
            'def second_largest(nums):\n    """Return the second largest distinct value in nums, or None."""\n    distinct = sorted(set(nums))\n    if len(distinct) < 2:\n        return None\n    return distinct[-2]\n',
        ],
        "calls": ["second_largest([4, 1, 4, 3])", "second_largest([2, 2])", "second_largest([10, 20, 30])"],
        "bugs": [("sorted(set(nums))", "sorted(nums)")],
    },
    {
        "names": ["to_binary", "int_to_binary"],
        "task": "return the binary representation of a non-negative integer as a string",
        "impls": [
            'def to_binary(n):\n    """Return the binary digits of the non-negative integer n."""\n    if n == 0:\n        return "0"\n    digits = []\n    while n > 0:\n        digits.append(str(n % 2))\n        n //= 2\n    return "".join(reversed(digits))\n',
        ],
        "calls": ["to_binary(0)", "to_binary(5)", "to_binary(10)"],
        "bugs": [('"".join(reversed(digits))', '"".join(digits)')],
    },
    {
        "names": ["is_leap_year", "leap_year"],
        "task": "tell whether a year is a leap year in the Gregorian calendar",
        "impls": [
            'def is_leap_year(year):\n    """Return True if year is a Gregorian leap year."""\n    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n',
        ],
        "calls": ["is_leap_year(2024)", "is_leap_year(1900)", "is_leap_year(2000)", "is_leap_year(2023)"],
        "bugs": [(" or year % 400 == 0", "")],
    },
    {
        "names": ["snake_to_camel", "to_camel_case"],
        "task": "convert a snake_case name to camelCase",
        "impls": [
            'def snake_to_camel(name):\n    """Convert a snake_case name to camelCase."""\n    first, *rest = name.split("_")\n    return first + "".join(part.capitalize() for part in rest)\n',
        ],
        "calls": ["snake_to_camel('max_line_length')", "snake_to_camel('name')"],
        "bugs": [("part.capitalize()", "part")],
    },
    {
        "names": ["count_occurrences", "count_item"],
        "task": "count how many times a value occurs in a list",
        "impls": [
            'def count_occurrences(items, value):\n    """Return how many elements of items equal value."""\n    count = 0\n    for x in items:\n        if x == value:\n            count += 1\n    return count\n',
        ],
        "calls": ["count_occurrences([1, 2, 1, 1], 1)", "count_occurrences(['a', 'b'], 'c')"],
        "bugs": [("if x == value:", "if x != value:")],
    },
    {
        "names": ["parse_key_value", "parse_pair"],
        "task": "parse a 'key=value' line into a (key, value) tuple with surrounding spaces removed",
        "impls": [
            'def parse_key_value(line):\n    """Split a \'key=value\' line into a (key, value) tuple, stripping spaces."""\n    key, _, value = line.partition("=")\n    return key.strip(), value.strip()\n',
        ],
        "calls": ["parse_key_value('name = demo')", "parse_key_value('x=1')"],
        "bugs": [("value.strip()", "value")],
    },
]


class _StepLimit(Exception):
    pass


def run_call(src: str, name: str, call: str, max_lines: int = 20000) -> str:
    """repr() of evaluating `call` after defining `src` (the function named `name`), or the
    exception as 'TypeName: message'. Execution is cut after max_lines traced lines."""
    return evaluate(src, call, max_lines)[1]


def evaluate(src: str, call: str, max_lines: int = 20000):
    """(True, repr(value)) or (False, 'TypeName: message') of `call` after defining `src`."""
    ns: Dict[str, Any] = {}
    count = [0]

    def tracer(frame, event, arg):
        if event == "line":
            count[0] += 1
            if count[0] > max_lines:
                raise _StepLimit()
        return tracer

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        exec(compile(src, "<classic>", "exec"), ns)
        return True, repr(eval(call, ns))
    except _StepLimit:
        return False, "TimeoutError: execution did not finish"
    except Exception as e:  # noqa: BLE001 - the failure text is the data
        return False, f"{type(e).__name__}: {e}"
    finally:
        sys.settrace(old)


def renamed(src: str, old: str, new: str) -> str:
    """The source with the function name `old` replaced by `new` where it is called or
    defined (the name followed by an opening parenthesis)."""
    import re

    return re.sub(r"\b%s(?=\()" % re.escape(old), new, src)
