"""The clause types of a synthetic contract and the phrasings each one is written in.

Every clause type has several *main* templates (one sentence carrying the clause's key fact, the
one its questions ask about) and a pool of *extra* sentences on the same topic. A clause paragraph
is one main sentence plus a few extras in random order; a secondary paragraph of the same type is
extras only. Slots: `{A}`/`{B}` the parties' role names ("the Supplier", "the Customer"),
`{a}`/`{b}` their company names, `{n}`/`{n2}` small numbers written out, `{city}`, `{law}`, and
each type's key fact (`{penalty}`, `{court}`, `{duration}`, `{owner}`, `{notice}`, `{price}`,
`{pay_days}`, `{term_notice}`, `{period}`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ClauseType:
    """One label: its id (used in files and configs), English name and Chinese name."""

    id: str
    en: str
    zh: str


CLAUSE_TYPES: tuple[ClauseType, ...] = (
    ClauseType("breach", "breach of contract", "违约责任"),
    ClauseType("jurisdiction", "jurisdiction", "管辖法院"),
    ClauseType("confidentiality", "confidentiality", "保密义务"),
    ClauseType("intellectual_property", "intellectual property", "知识产权"),
    ClauseType("force_majeure", "force majeure", "不可抗力"),
    ClauseType("payment", "payment terms", "付款条款"),
    ClauseType("termination", "termination", "终止条款"),
    ClauseType("warranty", "warranty", "保证条款"),
)
LABELS: tuple[str, ...] = tuple(c.id for c in CLAUSE_TYPES)
BY_ID: dict[str, ClauseType] = {c.id: c for c in CLAUSE_TYPES}

MAIN: dict[str, list[str]] = {
    "breach": [
        "If either party materially breaches this Agreement, the breaching party shall pay the "
        "other party liquidated damages of {penalty}.",
        "Should {A} fail to perform any of its obligations hereunder, {A} shall be liable to {B} "
        "for liquidated damages in the amount of {penalty}, without prejudice to any other remedy.",
        "In the event of a default by either party, the defaulting party agrees to compensate the "
        "non-defaulting party by way of liquidated damages of {penalty}.",
        "A party that violates any material term of this Agreement shall owe the other party, as a "
        "genuine pre-estimate of loss and not as a penalty, an amount equal to {penalty}.",
        "Where {B} or {A} fails to comply with its undertakings, the party in default must pay "
        "{penalty} to the other as agreed compensation for the non-performance.",
        "Any failure to perform that is not cured as provided below entitles the injured party to "
        "recover liquidated damages of {penalty} from the party at fault.",
    ],
    "jurisdiction": [
        "Any dispute arising out of or in connection with this Agreement shall be submitted to the "
        "exclusive jurisdiction of the courts of {court}, and this Agreement is governed by {law}.",
        "This Agreement shall be governed by {law}, and the parties irrevocably submit to the "
        "exclusive jurisdiction of the competent courts located in {court}.",
        "All claims and controversies between the parties relating to this Agreement shall be heard "
        "and determined exclusively by the courts sitting in {court}, applying {law}.",
        "The parties agree that the courts of {court} alone shall have jurisdiction to settle any "
        "dispute under this Agreement, which shall be construed in accordance with {law}.",
        "Each party consents to the exclusive venue of the courts in {court} for any action "
        "brought under this Agreement; the Agreement is subject to {law}.",
    ],
    "confidentiality": [
        "Each party shall keep confidential all non-public information received from the other "
        "party and shall not disclose it to any third party for {duration} after disclosure.",
        "The receiving party undertakes to hold the disclosing party's Confidential Information in "
        "strict confidence for a period of {duration} from the date of this Agreement.",
        "{A} and {B} shall each protect the other's trade secrets and business information from "
        "disclosure, and this obligation survives for {duration} after the Agreement ends.",
        "Neither party may reveal, publish or otherwise make available the Confidential Information "
        "of the other party during the term of this Agreement and for {duration} thereafter.",
        "All information marked or reasonably understood as confidential shall be kept secret by "
        "the recipient, and the duty of secrecy shall last for {duration}.",
    ],
    "intellectual_property": [
        "All intellectual property rights in the deliverables, including copyright, patents and "
        "designs, shall vest in and remain the exclusive property of {owner}.",
        "Any inventions, works of authorship and know-how created in the course of performing this "
        "Agreement shall be owned solely by {owner}.",
        "Ownership of all patents, copyrights, trademarks and other proprietary rights arising from "
        "the work product is hereby assigned to and shall belong to {owner}.",
        "The parties acknowledge that {owner} shall hold all right, title and interest in the "
        "software, documentation and other materials developed under this Agreement.",
        "Every improvement, derivative work and invention conceived under this Agreement is the "
        "property of {owner}, which may register it in its own name.",
    ],
    "force_majeure": [
        "Neither party shall be liable for delay or failure to perform caused by events beyond its "
        "reasonable control, such as natural disasters, war or epidemics, provided that it notifies "
        "the other party within {notice} of the event.",
        "A party prevented from performing by an act of God, flood, fire, strike, pandemic or "
        "government action shall be excused for the duration of that event if it gives written "
        "notice within {notice}.",
        "If an earthquake, typhoon, war, riot, embargo or similar unforeseeable event prevents "
        "performance, the affected party is released from liability, on condition that it informs "
        "the other party within {notice} of its occurrence.",
        "Performance is suspended while a force majeure event continues; the party relying on such "
        "an event must notify the other party in writing within {notice} and provide evidence.",
        "Circumstances that could not be foreseen or avoided, including storms, epidemics, "
        "blockades and changes in law, excuse a party's non-performance if it reports them within "
        "{notice}.",
    ],
    "payment": [
        "{B} shall pay {A} the total contract price of {price}, and each invoice shall be paid "
        "within {pay_days} of receipt.",
        "In consideration of the services, {B} agrees to pay a total fee of {price}, payable in "
        "instalments, each within {pay_days} after the date of the relevant invoice.",
        "The aggregate price for the deliverables is {price}; {A} will invoice monthly and {B} "
        "shall settle every undisputed invoice within {pay_days}.",
        "{B} will remit the contract sum of {price} by bank transfer to the account designated by "
        "{A}, with payment due {pay_days} from the invoice date.",
        "The fees payable under this Agreement total {price}, and amounts invoiced by {A} fall due "
        "for payment within {pay_days}.",
    ],
    "termination": [
        "Either party may terminate this Agreement for convenience by giving the other party "
        "written notice of {term_notice}.",
        "This Agreement may be terminated by {B} at any time upon prior written notice of "
        "{term_notice} to {A}, without the need to state a reason.",
        "Without cause, either party may bring this Agreement to an end by serving notice in "
        "writing on the other party {term_notice} in advance.",
        "A party wishing to end this Agreement before its expiry shall give the other party "
        "notice of termination in writing not less than {term_notice} beforehand.",
        "The parties may terminate this Agreement early, for any reason, by delivering written "
        "notice to the other party at least {term_notice} in advance.",
    ],
    "warranty": [
        "{A} warrants that the deliverables will conform to the specifications and be free from "
        "defects in materials and workmanship for {period} from acceptance.",
        "For a period of {period} after delivery, {A} guarantees that the products will perform "
        "substantially in accordance with the documentation.",
        "{A} represents and warrants that all services will be performed in a professional manner "
        "and that any defect reported within {period} will be remedied free of charge.",
        "The goods supplied are guaranteed against faulty design, materials and workmanship during "
        "a warranty period of {period} commencing on the date of acceptance.",
        "{A} gives a warranty of {period} on all deliverables, during which it shall repair or "
        "replace any non-conforming item at its own cost.",
    ],
}

EXTRA: dict[str, list[str]] = {
    "breach": [
        "The non-breaching party shall first give written notice describing the breach, and the "
        "breaching party shall have {n} days to cure it.",
        "Liquidated damages do not limit the right of {B} to claim further compensation for losses "
        "exceeding that amount.",
        "A repeated failure to meet the service levels counts as a material breach of this "
        "Agreement.",
        "The party in breach shall also reimburse reasonable legal fees incurred by the other party "
        "in enforcing its rights.",
        "If the breach is not remedied within {n2} days of the notice, the injured party may "
        "suspend its own performance until the default is corrected.",
        "{A} may set off any damages owed by {B} against amounts it owes to {B} under this "
        "Agreement.",
        "Late delivery by more than {n} days is treated as a default for which the defaulting "
        "party is answerable.",
        "The injured party remains entitled to seek specific performance of the obligations "
        "that were not fulfilled.",
        "Neither party is liable for indirect or consequential losses arising from a breach, "
        "except in cases of wilful misconduct.",
    ],
    "jurisdiction": [
        "The parties shall first try to settle any dispute amicably through negotiation between "
        "senior executives for {n} days.",
        "Nothing in this section prevents a party from seeking urgent injunctive relief in any "
        "court of competent jurisdiction.",
        "The United Nations Convention on Contracts for the International Sale of Goods does not "
        "apply to this Agreement.",
        "Each party waives any objection to proceedings in that forum on the grounds of venue or "
        "inconvenient forum.",
        "Judgments rendered by those courts may be enforced in any other country where the losing "
        "party holds assets.",
        "Service of process may be effected by courier to the addresses set out in the notices "
        "provision.",
        "Pending the outcome of any litigation, the parties shall continue to perform their "
        "undisputed obligations.",
        "The conflict of laws rules of that jurisdiction shall not be applied to refer the matter "
        "to any other legal system.",
    ],
    "confidentiality": [
        "Confidential Information does not include information that is or becomes publicly "
        "available through no fault of the receiving party.",
        "The recipient may disclose Confidential Information to its employees and advisers who "
        "need to know it and are bound by equivalent duties of secrecy.",
        "On request, {B} shall return or destroy all documents containing the other party's "
        "Confidential Information within {n} days.",
        "Disclosure required by law or by a regulator is permitted, provided the disclosing party "
        "is notified promptly.",
        "{A} shall apply at least the same degree of care to the information as it uses to protect "
        "its own sensitive data.",
        "Neither party shall use the other's information for any purpose other than performing "
        "this Agreement.",
        "The terms of this Agreement themselves shall be treated as secret and shall not be "
        "announced publicly without prior consent.",
        "Any unauthorised disclosure shall be reported to the disclosing party within {n2} "
        "business days of its discovery.",
    ],
    "intellectual_property": [
        "Each party retains ownership of the pre-existing materials and background technology it "
        "brings to the project.",
        "{A} grants {B} a non-exclusive, royalty-free licence to use any background materials "
        "embedded in the deliverables.",
        "The parties shall execute any further documents reasonably required to perfect the "
        "assignment of rights.",
        "Neither party may use the other's trademarks or logos without prior written approval.",
        "{A} shall indemnify {B} against claims that the deliverables infringe the patents or "
        "copyrights of a third party.",
        "Moral rights in the works are waived to the fullest extent permitted by applicable law.",
        "Source code for the custom components shall be delivered to {B} within {n} days of "
        "acceptance.",
        "Open-source components may be included only if their licence terms have been disclosed in "
        "advance.",
    ],
    "force_majeure": [
        "The affected party shall use all reasonable efforts to mitigate the effects of the event "
        "and to resume performance as soon as possible.",
        "If the event continues for more than {n} days, either party may terminate this Agreement "
        "by written notice without liability.",
        "Lack of funds or a mere increase in costs shall not be regarded as an excusing event.",
        "Time limits for performance are extended by a period equal to the duration of the event.",
        "The affected party shall provide a certificate issued by a chamber of commerce or similar "
        "authority confirming the circumstances.",
        "Obligations to pay money that were due before the event occurred are not suspended.",
        "Labour disputes involving the affected party's own workforce shall not excuse "
        "performance.",
        "The parties shall meet within {n2} days after the notice to agree on a plan for continued "
        "performance.",
    ],
    "payment": [
        "All amounts are stated exclusive of value added tax, which shall be added at the "
        "applicable rate.",
        "Late payments bear interest at {n} percent per annum above the central bank base rate.",
        "{B} may withhold payment of any amount it disputes in good faith, provided it notifies "
        "{A} of the reasons.",
        "Invoices shall state the purchase order number and be sent to the accounts payable "
        "department of {b}.",
        "An advance of {n2} percent of the fees is payable on signature of this Agreement.",
        "Each party bears its own bank charges for transfers made under this Agreement.",
        "Prices are fixed for the first year and may be adjusted annually in line with the "
        "consumer price index.",
        "Payments shall be made in the currency stated on the invoice without any deduction or "
        "set-off.",
    ],
    "termination": [
        "Either party may terminate immediately if the other party becomes insolvent or enters "
        "into liquidation.",
        "Upon termination, {A} shall hand over all work in progress and {B} shall pay for "
        "services performed up to the termination date.",
        "Termination does not affect rights and liabilities that accrued before the date on which "
        "it takes effect.",
        "The provisions on confidentiality, liability and governing law survive the termination or "
        "expiry of this Agreement.",
        "If the other party commits a material breach that remains unremedied for {n} days, the "
        "Agreement may be terminated forthwith.",
        "Within {n2} days after the Agreement ends, each party shall return the other party's "
        "property and equipment.",
        "This Agreement shall expire automatically at the end of its term unless renewed in "
        "writing.",
        "A change of control of {A} entitles {B} to terminate this Agreement on written notice.",
    ],
    "warranty": [
        "This warranty does not cover defects caused by misuse, accident or modification by anyone "
        "other than {A}.",
        "{A} further warrants that it holds all licences and permits necessary to perform its "
        "obligations.",
        "Defective items shall be repaired or replaced within {n} days of a written claim.",
        "Except as expressly stated, all other warranties, whether express or implied, are "
        "excluded.",
        "Replacement parts carry the remainder of the original warranty period or {n2} days, "
        "whichever is longer.",
        "{B} shall notify {A} of any defect promptly after discovering it and give access for "
        "inspection.",
        "The deliverables shall comply with all applicable safety standards and regulations in "
        "force at the time of delivery.",
        "{A} warrants that the software will not contain viruses or other malicious code when "
        "delivered.",
    ],
}

# Unlabeled boilerplate paragraphs (outside every span): general provisions and schedules.
BOILERPLATE: list[str] = [
    "Notices under this Agreement shall be in writing and delivered by hand, courier or email to "
    "the addresses stated above, and take effect on receipt.",
    "Neither party may assign or transfer its rights under this Agreement without the prior "
    "written consent of the other party, which shall not be unreasonably withheld.",
    "If any provision of this Agreement is held invalid, the remaining provisions shall continue "
    "in full force and effect.",
    "This Agreement constitutes the entire agreement between the parties and supersedes all prior "
    "negotiations, representations and understandings.",
    "No amendment to this Agreement is effective unless made in writing and signed by authorised "
    "representatives of both parties.",
    "This Agreement may be executed in any number of counterparts, each of which is an original "
    "and all of which together form one instrument.",
    "A failure or delay in exercising any right does not operate as a waiver of that right.",
    "Nothing in this Agreement creates a partnership, joint venture or agency relationship between "
    "the parties.",
    "{A} shall maintain adequate insurance cover with reputable insurers throughout the term and "
    "provide certificates on request.",
    "{B} may audit the records of {A} relating to this Agreement once per calendar year on {n} "
    "days' notice.",
    "{A} may engage subcontractors only with the prior written approval of {B} and remains "
    "responsible for their work.",
    "Each party shall comply with applicable anti-bribery and anti-corruption laws in performing "
    "this Agreement.",
    "The parties shall appoint project managers who will meet every {n} weeks to review progress "
    "against the plan.",
    "Headings are for convenience only and do not affect the interpretation of this Agreement.",
    "Each party shall bear its own costs in connection with the negotiation and execution of this "
    "Agreement.",
    "The parties shall process personal data only as required to perform this Agreement and in "
    "accordance with applicable data protection law.",
    "{A} shall provide monthly progress reports to {b} describing completed milestones, risks and "
    "planned activities.",
    "The initial term of this Agreement is {n} years from the effective date, after which it "
    "renews for successive one-year periods.",
    "Acceptance testing shall take place within {n2} days after delivery according to the test "
    "plan agreed by the parties.",
    "{A} shall staff the project with qualified personnel and replace any individual reasonably "
    "objected to by {B}.",
    "During the term and for {n} months thereafter, neither party shall solicit the employees of "
    "the other party.",
    "Each party represents that it has full power and authority to enter into this Agreement.",
]

SCHEDULE_ITEMS: list[str] = [
    "Deliverable {k}: {adj} {thing} for the {dept} department, to be completed by {date}.",
    "Milestone {k}: delivery of the {adj} {thing} and related training, scheduled for {date}.",
    "Service item {k}: ongoing support of the {thing} used by the {dept} team, reviewed on {date}.",
    "Work package {k}: design and installation of a {adj} {thing} at the {dept} site by {date}.",
]
ADJECTIVES = ["integrated", "modular", "cloud-based", "automated", "redundant", "portable",
              "high-capacity", "secure", "low-latency", "custom"]
THINGS = ["inventory platform", "reporting dashboard", "conveyor system", "billing engine",
          "sensor network", "data warehouse", "cold-storage unit", "mobile application",
          "routing module", "access control system"]
DEPTS = ["finance", "logistics", "procurement", "research", "customer service", "production",
         "quality assurance", "human resources"]

# Needles planted early: a fact unrelated to every clause type, its question and the answer slot.
NEEDLES: list[tuple[str, str]] = [
    ("The internal project passkey for this Agreement is {code}.",
     "What is the internal project passkey for this Agreement?"),
    ("For audit purposes, the escrow reference number of this Agreement is {code}.",
     "What is the escrow reference number of the Agreement?"),
    ("The parties record that the archive locker code for the signed originals is {code}.",
     "What is the archive locker code for the signed originals?"),
    ("The file registration code assigned to this Agreement by the registry is {code}.",
     "What file registration code did the registry assign to the Agreement?"),
]

# Questions: (label) -> phrasings asking for the clause's key fact.
QA: dict[str, list[str]] = {
    "breach": ["What liquidated damages does a party in breach have to pay?",
               "How much compensation is owed by the party that breaches the contract?",
               "What is the amount of liquidated damages for a breach of the Agreement?"],
    "jurisdiction": ["Which city's courts have jurisdiction over disputes under the Agreement?",
                     "Where must disputes about this contract be litigated?",
                     "Which courts decide disputes arising from the Agreement?"],
    "confidentiality": ["How long do the confidentiality obligations last?",
                        "For what period must the parties keep each other's information secret?",
                        "What is the duration of the duty of confidentiality?"],
    "intellectual_property": ["Who owns the intellectual property created under the Agreement?",
                              "Which party holds the rights to the deliverables and inventions?",
                              "To whom do the patents and copyrights in the work product belong?"],
    "force_majeure": ["Within what time must a force majeure event be notified?",
                      "How quickly must a party report an event beyond its control?",
                      "What is the notice period for invoking force majeure?"],
    "payment": ["What is the total contract price?",
                "How much does the customer pay in total under the Agreement?",
                "What is the total fee payable under this contract?"],
    "termination": ["How much notice is needed to terminate the Agreement for convenience?",
                    "What notice period applies when a party ends the contract without cause?",
                    "How far in advance must termination without cause be notified?"],
    "warranty": ["How long is the warranty period?",
                 "For how long are the deliverables guaranteed against defects?",
                 "What is the length of the warranty given on the deliverables?"],
}

FUZZY: dict[str, list[str]] = {
    "breach": ["that place where it said we'd have to pay if we mess up — how is it calculated?",
               "the bit about what happens money-wise if somebody doesn't hold up their end?"],
    "jurisdiction": ["if this turns into a fight, where would we end up arguing it?",
                     "remind me, which town's judges get the final say if things go wrong?"],
    "confidentiality": ["how long do we have to keep quiet about their stuff?",
                        "that secrecy part — when are we finally allowed to talk?"],
    "intellectual_property": ["who ends up owning the things that get built?",
                              "the part about who keeps the inventions and code afterwards?"],
    "force_majeure": ["if a storm or something stops us, how fast do we need to tell them?",
                      "the thing about disasters — what's the deadline to let them know?"],
    "payment": ["once they bill us, how long before the money has to go out?",
                "the part on invoices — when exactly is the cash due?"],
    "termination": ["if we just want out, how much heads-up do we owe them?",
                    "how early do we have to warn them before walking away from the deal?"],
    "warranty": ["how long are they on the hook if the thing turns out broken?",
                 "that guarantee thing — how many months does it cover?"],
}

# Questions kept apart from QA/FUZZY/NEEDLES (the bench's and `kite data traffic`'s phrasings):
# the query side of the tagger is calibrated on these (kite.data.traffic.calibration_queries), so
# its held-out accuracy on the bench's phrasings measures questions it has never seen.
QA_CALIBRATION: dict[str, list[str]] = {
    "breach": ["What penalty applies if a party fails to perform its obligations?",
               "What does the defaulting party owe under the liquidated damages clause?",
               "How are damages for non-performance calculated?",
               "What sum is payable to the injured party after a material breach?"],
    "jurisdiction": ["Which law governs this contract and where are the courts?",
                     "In which city would a lawsuit about the Agreement be heard?",
                     "What is the venue for legal proceedings under the contract?",
                     "Which courts have exclusive jurisdiction?"],
    "confidentiality": ["How many years does the secrecy obligation survive?",
                        "When does the duty to protect confidential information end?",
                        "How long must trade secrets be kept from third parties?",
                        "What is the term of the non-disclosure obligation?"],
    "intellectual_property": ["Which party owns the copyright in the deliverables?",
                              "Who holds the patents on inventions made during the project?",
                              "Who is the owner of the work product?",
                              "Who gets the IP rights in what is developed?"],
    "force_majeure": ["How many days does a party have to give notice of a force majeure event?",
                      "What is the deadline for notifying an act of God?",
                      "How soon must an unforeseeable event preventing performance be reported?",
                      "What notice is required when circumstances beyond control delay work?"],
    "payment": ["What is the contract price?", "How much is the total fee?",
                "What amount does the client pay for the services?",
                "What is the overall price stated in the payment clause?"],
    "termination": ["What is the notice period for terminating for convenience?",
                    "How many days of notice are needed to end the Agreement without cause?",
                    "How can a party terminate the contract early, and with what notice?",
                    "What advance notice must be given before cancelling the Agreement?"],
    "warranty": ["How many months does the warranty cover?",
                 "What is the guarantee period for the deliverables?",
                 "For how long does the supplier warrant the work against defects?",
                 "When does the warranty on the goods expire?"],
}
FUZZY_CALIBRATION: dict[str, list[str]] = {
    "breach": ["what do we owe them if we drop the ball?",
               "say we screw up the delivery — what's it going to cost us?",
               "the money part when someone doesn't do what they promised?"],
    "jurisdiction": ["where would we have to go if we end up suing each other?",
                     "whose judges would sort it out if we disagree?",
                     "which place handles it if it all blows up?"],
    "confidentiality": ["how long until we can mention their stuff to other people?",
                        "when does the hush-hush part stop applying?",
                        "can we tell anyone about their plans, and for how long not?"],
    "intellectual_property": ["the stuff we make together — whose is it at the end?",
                              "who keeps the code and designs once we're done?",
                              "do we get to keep what we build or do they?"],
    "force_majeure": ["if an earthquake hits, how long do we have to warn them?",
                      "something out of our hands happens — when do we have to say so?",
                      "the bit about floods and wars, how quickly do we tell them?"],
    "payment": ["when do we actually have to pay the bill?",
                "how many days after the invoice does the money need to arrive?",
                "so how much are we paying them overall?"],
    "termination": ["if we want to pull out, how early do we say so?",
                    "can we just walk away, and how much warning do they get?",
                    "how do we get out of this deal if we change our minds?"],
    "warranty": ["if it breaks after a while, are they still responsible?",
                 "how long can we complain about faulty stuff?",
                 "the cover for broken things — how long is it good for?"],
}
# Not about one clause type: label None.
NONE_CALIBRATION: dict[str, list[str]] = {
    "needle": ["What is the reference code recorded in the Agreement?",
               "What project code appears in the recitals?",
               "Which registration number is quoted at the start of the contract?",
               "What is the access code mentioned in the Agreement?"],
    "contract": ["What is this agreement about?", "Give me the key points of the contract.",
                 "Who signed this document?", "When was the Agreement made?",
                 "What are the most important terms here?",
                 "How does this version compare with the last one overall?"],
    "off_topic": ["What's a good recipe for pancakes?", "How tall is Mount Everest?",
                  "Write a short poem about the sea.", "How do I centre a div in CSS?",
                  "What is the population of Canada?", "hello", "thank you", "good morning",
                  "What movies are showing tonight?", "How do I fix a flat bicycle tyre?",
                  "What is 45 divided by 9?", "Tell me something interesting about owls."],
}

# Completion-style prompts (the bench's `prompt` of a question): the start of a sentence whose
# continuation is the key fact, as `make demo` asks. The 135M model rarely answers a chat-formatted
# question from a long document, but it continues such a sentence (docs/bench-cases.md has the
# full-prefill F1 of each prompt format).
CLOZE: dict[str, str] = {
    "breach": "In short, a party in breach must pay liquidated damages of",
    "jurisdiction": "In short, any action under this Agreement must be brought before the courts in",
    "confidentiality": "In short, the duty of confidentiality lasts for",
    "intellectual_property": "In short, the intellectual property in the deliverables belongs to",
    "force_majeure": "In short, a force majeure event must be notified within",
    "payment": "In short, the fees payable under this Agreement total",
    "termination": "In short, termination for convenience requires a notice period of",
    "warranty": "In short, the warranty period is",
}
CLOZE_PAY_DAYS = "In short, invoices must be paid within"  # the fuzzy payment question's fact

# Long documents, once the boilerplate above is used up: definitions and scope-of-work prose.
DEFINITIONS: list[str] = [
    '"Business Day" means a day other than a Saturday, Sunday or public holiday in {city}.',
    '"Deliverables" means all documents, software and other items to be supplied by {A} as '
    "described in the schedules.",
    '"Effective Date" means the date on which this Agreement has been signed by both parties.',
    '"Personnel" means the employees, agents and subcontractors engaged by a party.',
    '"Specifications" means the functional and technical requirements agreed in writing.',
    '"Change Request" means a written proposal by either party to alter the scope of the work.',
    '"Site" means the premises of {B} at which the services are to be performed.',
    '"Service Levels" means the performance standards set out in the service level annex.',
    '"Acceptance Certificate" means the document issued by {B} confirming that a milestone has '
    "passed its tests.",
    '"Project Plan" means the timetable of milestones agreed at the kick-off meeting.',
    '"Affiliate" means any entity that controls, is controlled by or is under common control '
    "with a party.",
    '"Documentation" means the user manuals and operating instructions for the Deliverables.',
    '"Working Hours" means 9:00 to 17:00 local time on Business Days.',
    '"Steering Committee" means the body made up of senior representatives of both parties.',
]
SCOPE_SENTENCES: list[str] = [
    "{A} shall {verb} the {adj} {thing} used by the {dept} department.",
    "The work includes {activity}, {activity2} and {activity3}.",
    "{B} shall provide {resource} to support the {dept} team during {phase}.",
    "Progress on the {thing} will be measured against {metric}.",
    "During {phase}, {A} will {verb} the {thing} in close cooperation with the {dept} team.",
    "Any {adj} components of the {thing} shall be documented before {phase} begins.",
    "{A} will assign a lead engineer to the {thing} for the whole of {phase}.",
]
VERBS = ["design", "install", "configure", "migrate", "maintain", "upgrade", "test", "document",
         "integrate", "monitor"]
ACTIVITIES = ["requirements workshops", "data migration", "user training", "load testing",
              "a security review", "site surveys", "hypercare support", "capacity planning",
              "interface development", "report design"]
RESOURCES = ["office space", "test data", "remote access", "subject-matter experts",
             "a project sponsor", "meeting rooms", "sample products"]
PHASES = ["the pilot phase", "the roll-out", "acceptance testing", "the transition period",
          "the stabilisation period", "the design phase"]
METRICS = ["the agreed milestone plan", "the service level targets", "weekly status reports",
           "the quality plan", "the acceptance criteria"]
