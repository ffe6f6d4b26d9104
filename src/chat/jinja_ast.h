// The parsed form of a Jinja template: expressions and statement nodes (jinja_parse.cpp builds
// them, jinja_eval.cpp walks them).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "chat/jinja_value.h"

namespace minids::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
    enum class Kind {
        literal,  // literal
        name,     // name
        list,     // args: items
        tuple,    // args: items
        dict,     // args: key, value, key, value, ...
        getattr,  // args[0].name
        getitem,  // args[0][args[1]]
        slice,    // args[0][args[1]:args[2]:args[3]] (null where left out)
        call,     // args[0](args[1..], kwargs)
        filter,   // args[0] | name(args[1..], kwargs)
        test,     // args[0] is [not] name(args[1..])
        neg,      // -args[0]
        logical_not,
        logical_and,
        logical_or,
        binary,       // args[0] name args[1], name in + - * / // % ** ~
        compare,      // args[0] ops[0] args[1] ops[1] args[2] ... (chained)
        conditional,  // args[0] if args[1] else args[2] (args[2] may be null)
    };
    Kind kind = Kind::literal;
    int line = 0;
    Value literal;
    std::string name;
    std::vector<ExprPtr> args;
    std::vector<std::pair<std::string, ExprPtr>> kwargs;
    std::vector<std::string> ops;
    bool negated = false;  // `is not`
    // Levels of this tree (1 for a leaf). The parser refuses trees deeper than jinja_max_depth,
    // so evaluating (and destroying) one recurses a bounded number of times.
    int depth = 1;
};

struct Node {
    enum class Kind {
        block,      // children, in order
        text,       // text
        output,     // {{ expr }}
        if_chain,   // conditions[k] -> children[k]; one extra child is the else
        for_loop,   // for targets in expr [if filter]: children[0]; children[1] is the else
        set,        // set targets = expr, or set targets[0].attr = expr
        set_block,  // {% set targets[0] %}children[0]{% endset %}
        loop_break,
        loop_continue,
    };
    Kind kind = Kind::block;
    int line = 0;
    std::string text;
    ExprPtr expr;
    ExprPtr filter;
    std::vector<ExprPtr> conditions;
    std::vector<std::string> targets;
    std::string attr;
    std::vector<Node> children;
};

// Parses a whole template into a block node. Throws ChatTemplateError naming the line.
Node parse_template(std::string_view source);

}  // namespace minids::jinja
