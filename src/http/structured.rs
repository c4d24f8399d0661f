//! Structured Field dictionaries (RFC 8941 §3.2), as far as `CDN-Cache-Control` (RFC
//! 9213, a dictionary) needs them: whether a field value parses, and the type of each
//! member's value. A field that does not parse is ignored whole (RFC 9213 §2.1), as is
//! one whose directives have values of the wrong type.

/// The type of a dictionary member's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Value {
    /// A member without a value (`no-store`): the boolean true.
    Bare,
    Integer,
    Decimal,
    String,
    Token,
    Binary,
    Boolean,
    InnerList,
}

/// The members of a dictionary (its keys, each with its value's type), from the field
/// lines `lines` combined; `None` when they do not parse as one.
pub(crate) fn dictionary<'a>(
    lines: impl Iterator<Item = &'a [u8]>,
) -> Option<Vec<(String, Value)>> {
    let mut combined = Vec::new();
    for (i, line) in lines.enumerate() {
        if i > 0 {
            combined.extend_from_slice(b", ");
        }
        combined.extend_from_slice(line);
    }
    let mut p = Parser {
        input: &combined,
        at: 0,
    };
    p.skip(b" ");
    let mut members = Vec::new();
    while !p.done() {
        let key = p.key()?;
        let value = if p.eat(b'=') {
            if p.peek() == Some(b'(') {
                p.inner_list()?;
                Value::InnerList
            } else {
                let value = p.bare_item()?;
                p.parameters()?;
                value
            }
        } else {
            p.parameters()?;
            Value::Bare
        };
        members.push((key, value));
        p.skip(b" \t");
        if p.done() {
            break;
        }
        if !p.eat(b',') {
            return None;
        }
        p.skip(b" \t");
        // A trailing comma.
        if p.done() {
            return None;
        }
    }
    Some(members)
}

struct Parser<'a> {
    input: &'a [u8],
    at: usize,
}

impl Parser<'_> {
    fn done(&self) -> bool {
        self.at >= self.input.len()
    }

    fn peek(&self) -> Option<u8> {
        self.input.get(self.at).copied()
    }

    fn eat(&mut self, byte: u8) -> bool {
        let eaten = self.peek() == Some(byte);
        self.at += usize::from(eaten);
        eaten
    }

    fn skip(&mut self, bytes: &[u8]) {
        while self.peek().is_some_and(|b| bytes.contains(&b)) {
            self.at += 1;
        }
    }

    fn take_while(&mut self, mut keep: impl FnMut(u8) -> bool) -> &[u8] {
        let start = self.at;
        while self.peek().is_some_and(&mut keep) {
            self.at += 1;
        }
        &self.input[start..self.at]
    }

    /// `( lcalpha / "*" ) *( lcalpha / DIGIT / "_" / "-" / "." / "*" )`
    fn key(&mut self) -> Option<String> {
        let first = self.peek()?;
        if !(first.is_ascii_lowercase() || first == b'*') {
            return None;
        }
        let key = self
            .take_while(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-.*".contains(&b));
        Some(String::from_utf8_lossy(key).into_owned())
    }

    /// `*( ";" *SP key [ "=" bare-item ] )`
    fn parameters(&mut self) -> Option<()> {
        while self.eat(b';') {
            self.skip(b" ");
            self.key()?;
            if self.eat(b'=') {
                self.bare_item()?;
            }
        }
        Some(())
    }

    /// `"(" *SP [ sf-item *( 1*SP sf-item ) *SP ] ")" parameters`
    fn inner_list(&mut self) -> Option<()> {
        if !self.eat(b'(') {
            return None;
        }
        loop {
            self.skip(b" ");
            if self.eat(b')') {
                return self.parameters();
            }
            self.bare_item()?;
            self.parameters()?;
            if !matches!(self.peek(), Some(b' ' | b')')) {
                return None;
            }
        }
    }

    fn bare_item(&mut self) -> Option<Value> {
        match self.peek()? {
            b'-' | b'0'..=b'9' => self.number(),
            b'"' => self.string(),
            b':' => self.binary(),
            b'?' => {
                self.at += 1;
                let bit = self.peek()?;
                self.at += 1;
                matches!(bit, b'0' | b'1').then_some(Value::Boolean)
            }
            b if b.is_ascii_alphabetic() || b == b'*' => {
                self.take_while(|b| b.is_ascii_alphanumeric() || b":/!#$%&'*+-.^_`|~".contains(&b));
                Some(Value::Token)
            }
            _ => None,
        }
    }

    /// An integer (at most 15 digits) or a decimal (at most 12 digits, a dot, 1 to 3).
    fn number(&mut self) -> Option<Value> {
        self.eat(b'-');
        let whole = self.take_while(|b| b.is_ascii_digit()).len();
        if whole == 0 {
            return None;
        }
        if !self.eat(b'.') {
            return (whole <= 15).then_some(Value::Integer);
        }
        let fraction = self.take_while(|b| b.is_ascii_digit()).len();
        (whole <= 12 && (1..=3).contains(&fraction)).then_some(Value::Decimal)
    }

    fn string(&mut self) -> Option<Value> {
        self.at += 1;
        loop {
            match self.peek()? {
                b'"' => {
                    self.at += 1;
                    return Some(Value::String);
                }
                b'\\' => {
                    self.at += 1;
                    if !matches!(self.peek()?, b'"' | b'\\') {
                        return None;
                    }
                    self.at += 1;
                }
                0x20..=0x7e => self.at += 1,
                _ => return None,
            }
        }
    }

    fn binary(&mut self) -> Option<Value> {
        self.at += 1;
        self.take_while(|b| b.is_ascii_alphanumeric() || b"+/=".contains(&b));
        self.eat(b':').then_some(Value::Binary)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(value: &str) -> Option<Vec<(String, Value)>> {
        dictionary(std::iter::once(value.as_bytes()))
    }

    #[test]
    fn dictionaries_parse_with_the_types_of_their_values() {
        let members = parse("max-age=10000, no-store, a=\"x\\\"y\", b=1.5, c=?1, d=tok/en, e=:aGk=:, f=(1 2);p, g;q=1").unwrap();
        let types: Vec<Value> = members.iter().map(|(_, v)| *v).collect();
        assert_eq!(
            types,
            [
                Value::Integer,
                Value::Bare,
                Value::String,
                Value::Decimal,
                Value::Boolean,
                Value::Token,
                Value::Binary,
                Value::InnerList,
                Value::Bare
            ]
        );
        assert_eq!(members[0].0, "max-age");
        assert_eq!(parse(""), Some(Vec::new()));
        assert_eq!(parse("  max-age=1  ").unwrap().len(), 1);
        // Field lines are combined.
        let two = dictionary(["max-age=1".as_bytes(), b"private"].into_iter()).unwrap();
        assert_eq!(two.len(), 2);
    }

    #[test]
    fn what_is_not_a_dictionary_does_not_parse() {
        for value in [
            "max-age=10000, &&&&&",
            "Max-Age=1",
            "max-age=1,",
            "max-age=1 private",
            "max-age=",
            "max-age=\"open",
            "max-age=1234567890123456",
            "max-age=1.2345",
            "a=?2",
            "a=(1",
            "a=:b",
        ] {
            assert_eq!(parse(value), None, "{value}");
        }
    }
}
