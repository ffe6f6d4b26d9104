// Recursive-descent parser for the Jinja subset (grammar and precedence follow
// jinja2/parser.py); the tokens come from jinja_lexer.h.
#include <algorithm>

#include "chat/jinja.h"
#include "chat/jinja_ast.h"
#include "chat/jinja_lexer.h"

namespace minids::jinja {

namespace {

class Parser {
public:
    explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

    Node parse_all() {
        Node root = parse_body({});
        if (cur().kind != Token::Kind::eof)
            syntax_error(cur().line, "unexpected '" + cur().text + "'");
        return root;
    }

private:
    const Token& cur() const { return t_[i_]; }
    const Token& peek(size_t k = 1) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
    bool at_op(const char* op) const { return cur().kind == Token::Kind::op && cur().text == op; }
    bool at_name(const char* name) const {
        return cur().kind == Token::Kind::name && cur().text == name;
    }
    void expect_op(const char* op) {
        if (!at_op(op))
            syntax_error(cur().line,
                         std::string("expected '") + op + "', found " + describe(cur()));
        ++i_;
    }
    std::string expect_name() {
        if (cur().kind != Token::Kind::name)
            syntax_error(cur().line, "expected a name, found " + describe(cur()));
        return t_[i_++].text;
    }
    void expect_block_end() {
        if (cur().kind != Token::Kind::block_end)
            syntax_error(cur().line, "expected '%}', found " + describe(cur()));
        ++i_;
    }
    static std::string describe(const Token& t) {
        switch (t.kind) {
            case Token::Kind::block_end:
                return "'%}'";
            case Token::Kind::var_end:
                return "'}}'";
            case Token::Kind::eof:
                return "the end of the template";
            case Token::Kind::string:
                return "a string";
            default:
                return "'" + t.text + "'";
        }
    }

    // Statements until a block tag whose keyword is in `ends` (left unconsumed after its
    // block_begin: cur() is the keyword).
    Node parse_body(std::initializer_list<std::string_view> ends) {
        Node block;
        block.kind = Node::Kind::block;
        block.line = cur().line;
        while (true) {
            const Token& tok = cur();
            if (tok.kind == Token::Kind::eof) {
                if (ends.size() != 0)
                    syntax_error(tok.line, "missing {% " + std::string(*(ends.end() - 1)) + " %}");
                return block;
            }
            if (tok.kind == Token::Kind::text) {
                Node n;
                n.kind = Node::Kind::text;
                n.text = tok.text;
                n.line = tok.line;
                block.children.push_back(std::move(n));
                ++i_;
            } else if (tok.kind == Token::Kind::var_begin) {
                ++i_;
                Node n;
                n.kind = Node::Kind::output;
                n.line = tok.line;
                n.expr = parse_expression();
                if (cur().kind != Token::Kind::var_end)
                    syntax_error(cur().line, "expected '}}', found " + describe(cur()));
                ++i_;
                block.children.push_back(std::move(n));
            } else if (tok.kind == Token::Kind::block_begin) {
                const Token& kw = peek();
                if (kw.kind == Token::Kind::name) {
                    for (auto e : ends) {
                        if (kw.text == e) {
                            ++i_;
                            return block;
                        }
                    }
                }
                ++i_;
                block.children.push_back(parse_statement());
            } else {
                syntax_error(tok.line, "unexpected " + describe(tok));
            }
        }
    }

    // Bounds the parser's (and so the renderer's) recursion: a hostile template of deeply
    // nested brackets or blocks fails with a message instead of overflowing the stack.
    struct DepthGuard {
        int& depth;
        DepthGuard(int& d, int line) : depth(d) {
            if (++depth > kMaxDepth)
                syntax_error(line, "nesting deeper than " + std::to_string(kMaxDepth) + " levels");
        }
        ~DepthGuard() { --depth; }
        DepthGuard(const DepthGuard&) = delete;
        DepthGuard& operator=(const DepthGuard&) = delete;
    };
    static constexpr int kMaxDepth = jinja_max_depth;

    Node parse_statement() {
        const DepthGuard guard(depth_, cur().line);
        const int line = cur().line;
        const std::string kw = expect_name();
        Node n;
        n.line = line;
        if (kw == "if") {
            n.kind = Node::Kind::if_chain;
            n.conditions.push_back(parse_expression());
            expect_block_end();
            while (true) {
                n.children.push_back(parse_body({"elif", "else", "endif"}));
                const std::string end = expect_name();
                if (end == "elif") {
                    n.conditions.push_back(parse_expression());
                    expect_block_end();
                } else if (end == "else") {
                    expect_block_end();
                    n.children.push_back(parse_body({"endif"}));
                    expect_name();
                    expect_block_end();
                    break;
                } else {
                    expect_block_end();
                    break;
                }
            }
        } else if (kw == "for") {
            n.kind = Node::Kind::for_loop;
            n.targets.push_back(expect_name());
            while (at_op(",")) {
                ++i_;
                n.targets.push_back(expect_name());
            }
            if (!at_name("in")) syntax_error(cur().line, "expected 'in' in the for statement");
            ++i_;
            n.expr = parse_or();  // no conditional: `if` here filters the loop
            if (at_name("if")) {
                ++i_;
                n.filter = parse_expression();
            }
            if (at_name("recursive"))
                syntax_error(cur().line, "recursive for loops are not supported");
            expect_block_end();
            n.children.push_back(parse_body({"else", "endfor"}));
            if (expect_name() == "else") {
                expect_block_end();
                n.children.push_back(parse_body({"endfor"}));
                expect_name();
            }
            expect_block_end();
        } else if (kw == "set") {
            n.targets.push_back(expect_name());
            if (at_op(".")) {
                ++i_;
                n.attr = expect_name();
            }
            while (at_op(",")) {
                ++i_;
                n.targets.push_back(expect_name());
            }
            if (at_op("=")) {
                ++i_;
                n.kind = Node::Kind::set;
                n.expr = parse_tuple_or_expression();
                expect_block_end();
            } else {
                if (!n.attr.empty() || n.targets.size() != 1)
                    syntax_error(line, "a block set takes one plain name");
                n.kind = Node::Kind::set_block;
                expect_block_end();
                n.children.push_back(parse_body({"endset"}));
                expect_name();
                expect_block_end();
            }
        } else if (kw == "break" || kw == "continue") {
            n.kind = kw == "break" ? Node::Kind::loop_break : Node::Kind::loop_continue;
            expect_block_end();
        } else if (kw == "generation") {
            // transformers' AssistantTracker extension: only marks assistant text; render the body.
            expect_block_end();
            n = parse_body({"endgeneration"});
            expect_name();
            expect_block_end();
        } else {
            syntax_error(line, "the '" + kw + "' statement is not supported");
        }
        return n;
    }

    ExprPtr make(Expr::Kind kind, int line) {
        auto e = std::make_unique<Expr>();
        e->kind = kind;
        e->line = line;
        return e;
    }

    // A node whose operands are all attached: its depth, refused past the limit. Chains the parser
    // builds in a loop (a + b + c ..., a.b.c ..., x | f | g ...) grow a tree without recursing, so
    // the parser's own recursion guard does not see them.
    ExprPtr finish(ExprPtr e) {
        int below = 0;
        for (const auto& a : e->args)
            if (a) below = std::max(below, a->depth);
        for (const auto& [name, a] : e->kwargs) below = std::max(below, a->depth);
        e->depth = below + 1;
        if (e->depth > kMaxDepth)
            syntax_error(e->line,
                         "expression nested deeper than " + std::to_string(kMaxDepth) + " levels");
        return e;
    }

    // `a, b` without brackets (e.g. in set) is a tuple.
    ExprPtr parse_tuple_or_expression() {
        ExprPtr first = parse_expression();
        if (!at_op(",")) return first;
        auto tuple = make(Expr::Kind::tuple, first->line);
        tuple->args.push_back(std::move(first));
        while (at_op(",")) {
            ++i_;
            tuple->args.push_back(parse_expression());
        }
        return finish(std::move(tuple));
    }

    ExprPtr parse_expression() {
        const DepthGuard guard(depth_, cur().line);
        ExprPtr e = parse_or();
        if (at_name("if")) {
            auto c = make(Expr::Kind::conditional, cur().line);
            ++i_;
            c->args.push_back(std::move(e));
            c->args.push_back(parse_or());
            if (at_name("else")) {
                ++i_;
                c->args.push_back(parse_expression());
            } else {
                c->args.push_back(nullptr);
            }
            return finish(std::move(c));
        }
        return e;
    }

    ExprPtr parse_or() {
        ExprPtr left = parse_and();
        while (at_name("or")) {
            auto e = make(Expr::Kind::logical_or, cur().line);
            ++i_;
            e->args.push_back(std::move(left));
            e->args.push_back(parse_and());
            left = finish(std::move(e));
        }
        return left;
    }

    ExprPtr parse_and() {
        ExprPtr left = parse_not();
        while (at_name("and")) {
            auto e = make(Expr::Kind::logical_and, cur().line);
            ++i_;
            e->args.push_back(std::move(left));
            e->args.push_back(parse_not());
            left = finish(std::move(e));
        }
        return left;
    }

    ExprPtr parse_not() {
        if (at_name("not")) {
            const DepthGuard guard(depth_, cur().line);
            auto e = make(Expr::Kind::logical_not, cur().line);
            ++i_;
            e->args.push_back(parse_not());
            return finish(std::move(e));
        }
        return parse_compare();
    }

    ExprPtr parse_compare() {
        ExprPtr first = parse_math1();
        ExprPtr cmp;
        while (true) {
            std::string op;
            if (cur().kind == Token::Kind::op && (at_op("==") || at_op("!=") || at_op("<") ||
                                                  at_op(">") || at_op("<=") || at_op(">="))) {
                op = cur().text;
                ++i_;
            } else if (at_name("in")) {
                op = "in";
                ++i_;
            } else if (at_name("not") && peek().kind == Token::Kind::name && peek().text == "in") {
                op = "not in";
                i_ += 2;
            } else {
                break;
            }
            if (!cmp) {
                cmp = make(Expr::Kind::compare, first->line);
                cmp->args.push_back(std::move(first));
            }
            cmp->ops.push_back(op);
            cmp->args.push_back(parse_math1());
        }
        return cmp ? finish(std::move(cmp)) : std::move(first);
    }

    ExprPtr binary(const std::string& op, ExprPtr left, ExprPtr right) {
        auto e = make(Expr::Kind::binary, left->line);
        e->name = op;
        e->args.push_back(std::move(left));
        e->args.push_back(std::move(right));
        return finish(std::move(e));
    }

    ExprPtr parse_math1() {
        ExprPtr left = parse_concat();
        while (at_op("+") || at_op("-")) {
            const std::string op = t_[i_++].text;
            left = binary(op, std::move(left), parse_concat());
        }
        return left;
    }

    ExprPtr parse_concat() {
        ExprPtr left = parse_math2();
        while (at_op("~")) {
            ++i_;
            left = binary("~", std::move(left), parse_math2());
        }
        return left;
    }

    ExprPtr parse_math2() {
        ExprPtr left = parse_pow();
        while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
            const std::string op = t_[i_++].text;
            left = binary(op, std::move(left), parse_pow());
        }
        return left;
    }

    ExprPtr parse_pow() {
        ExprPtr left = parse_unary(true);
        while (at_op("**")) {
            ++i_;
            left = binary("**", std::move(left), parse_unary(true));
        }
        return left;
    }

    ExprPtr parse_unary(bool with_filter) {
        const DepthGuard guard(depth_, cur().line);
        ExprPtr e;
        if (at_op("-") || at_op("+")) {
            const bool neg = at_op("-");
            const int line = cur().line;
            ++i_;
            ExprPtr operand = parse_unary(false);
            if (neg) {
                e = make(Expr::Kind::neg, line);
                e->args.push_back(std::move(operand));
                e = finish(std::move(e));
            } else {
                e = std::move(operand);
            }
        } else {
            e = parse_primary();
        }
        e = parse_postfix(std::move(e));
        if (with_filter) e = parse_filter_expr(std::move(e));
        return e;
    }

    ExprPtr parse_primary() {
        const Token& tok = cur();
        switch (tok.kind) {
            case Token::Kind::name: {
                ++i_;
                auto e = make(Expr::Kind::literal, tok.line);
                if (tok.text == "true" || tok.text == "True") {
                    e->literal = Value::boolean(true);
                } else if (tok.text == "false" || tok.text == "False") {
                    e->literal = Value::boolean(false);
                } else if (tok.text == "none" || tok.text == "None") {
                    e->literal = Value::none();
                } else {
                    e->kind = Expr::Kind::name;
                    e->name = tok.text;
                }
                return e;
            }
            case Token::Kind::string: {
                auto e = make(Expr::Kind::literal, tok.line);
                std::string s;
                while (cur().kind == Token::Kind::string)
                    s += t_[i_++].text;  // adjacent literals join
                e->literal = Value::string(std::move(s));
                return e;
            }
            case Token::Kind::integer:
            case Token::Kind::floating: {
                ++i_;
                auto e = make(Expr::Kind::literal, tok.line);
                try {
                    e->literal = tok.kind == Token::Kind::integer
                                     ? Value::integer(std::stoll(tok.text))
                                     : Value::floating(std::stod(tok.text));
                } catch (const std::exception&) {
                    syntax_error(tok.line, "number " + tok.text + " is out of range");
                }
                return e;
            }
            case Token::Kind::op:
                if (tok.text == "(") {
                    ++i_;
                    if (at_op(")")) {
                        ++i_;
                        return make(Expr::Kind::tuple, tok.line);
                    }
                    ExprPtr inner = parse_expression();
                    if (at_op(",")) {
                        auto tuple = make(Expr::Kind::tuple, tok.line);
                        tuple->args.push_back(std::move(inner));
                        while (at_op(",")) {
                            ++i_;
                            if (at_op(")")) break;
                            tuple->args.push_back(parse_expression());
                        }
                        inner = finish(std::move(tuple));
                    }
                    expect_op(")");
                    return inner;
                }
                if (tok.text == "[") {
                    ++i_;
                    auto list = make(Expr::Kind::list, tok.line);
                    while (!at_op("]")) {
                        list->args.push_back(parse_expression());
                        if (!at_op(",")) break;
                        ++i_;
                    }
                    expect_op("]");
                    return finish(std::move(list));
                }
                if (tok.text == "{") {
                    ++i_;
                    auto dict = make(Expr::Kind::dict, tok.line);
                    while (!at_op("}")) {
                        dict->args.push_back(parse_expression());
                        expect_op(":");
                        dict->args.push_back(parse_expression());
                        if (!at_op(",")) break;
                        ++i_;
                    }
                    expect_op("}");
                    return finish(std::move(dict));
                }
                break;
            default:
                break;
        }
        syntax_error(tok.line, "unexpected " + describe(tok) + " in an expression");
    }

    void parse_call_args(Expr& call) {
        expect_op("(");
        while (!at_op(")")) {
            if (cur().kind == Token::Kind::name && peek().kind == Token::Kind::op &&
                peek().text == "=") {
                std::string key = t_[i_].text;
                i_ += 2;
                call.kwargs.emplace_back(std::move(key), parse_expression());
            } else {
                if (!call.kwargs.empty())
                    syntax_error(cur().line, "positional argument after a keyword argument");
                call.args.push_back(parse_expression());
            }
            if (!at_op(",")) break;
            ++i_;
        }
        expect_op(")");
    }

    ExprPtr parse_postfix(ExprPtr e) {
        while (true) {
            if (at_op(".")) {
                ++i_;
                auto g = make(Expr::Kind::getattr, e->line);
                g->name = cur().kind == Token::Kind::integer ? t_[i_++].text : expect_name();
                g->args.push_back(std::move(e));
                e = finish(std::move(g));
            } else if (at_op("[")) {
                ++i_;
                ExprPtr parts[3];
                bool is_slice = false;
                for (int k = 0; k < 3; ++k) {
                    if (!at_op(":") && !at_op("]")) parts[k] = parse_expression();
                    if (!at_op(":") || k == 2) break;
                    is_slice = true;
                    ++i_;
                }
                expect_op("]");
                auto s = make(is_slice ? Expr::Kind::slice : Expr::Kind::getitem, e->line);
                if (!is_slice && !parts[0]) syntax_error(e->line, "empty subscript");
                s->args.push_back(std::move(e));
                for (int k = 0; k < (is_slice ? 3 : 1); ++k) s->args.push_back(std::move(parts[k]));
                e = finish(std::move(s));
            } else if (at_op("(")) {
                auto c = make(Expr::Kind::call, e->line);
                c->args.push_back(std::move(e));
                parse_call_args(*c);
                e = finish(std::move(c));
            } else {
                return e;
            }
        }
    }

    ExprPtr parse_filter_expr(ExprPtr e) {
        while (true) {
            if (at_op("|")) {
                ++i_;
                auto f = make(Expr::Kind::filter, e->line);
                f->name = expect_name();
                f->args.push_back(std::move(e));
                if (at_op("(")) parse_call_args(*f);
                e = finish(std::move(f));
            } else if (at_name("is")) {
                ++i_;
                auto t = make(Expr::Kind::test, e->line);
                if (at_name("not")) {
                    t->negated = true;
                    ++i_;
                }
                t->name = cur().kind == Token::Kind::name ? expect_name() : "";
                if (t->name.empty()) {
                    // `is none` lexes none as a name; `is ==` style tests are not in the subset.
                    syntax_error(cur().line, "expected a test name after 'is'");
                }
                t->args.push_back(std::move(e));
                if (at_op("(")) {
                    parse_call_args(*t);
                } else if ((cur().kind == Token::Kind::name && !at_name("else") && !at_name("or") &&
                            !at_name("and") && !at_name("if") && !at_name("not") &&
                            !at_name("in") && !at_name("is")) ||
                           cur().kind == Token::Kind::string ||
                           cur().kind == Token::Kind::integer ||
                           cur().kind == Token::Kind::floating || at_op("[") || at_op("{")) {
                    t->args.push_back(parse_postfix(parse_primary()));
                }
                e = finish(std::move(t));
            } else if (at_op("(")) {
                auto c = make(Expr::Kind::call, e->line);
                c->args.push_back(std::move(e));
                parse_call_args(*c);
                e = finish(std::move(c));
            } else {
                return e;
            }
        }
    }

    std::vector<Token> t_;
    size_t i_ = 0;
    int depth_ = 0;
};

}  // namespace

Node parse_template(std::string_view source) { return Parser(lex_template(source)).parse_all(); }

}  // namespace minids::jinja
